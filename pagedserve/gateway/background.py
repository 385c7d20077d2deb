"""Small asyncio helpers of the REST calls: work nobody waits for (`spawn`), and watching for a
client that went away while its response is being collected (`watch_disconnect`).

Threads: the serving event loop only. Invariant: a spawned task stays referenced until it is
done (the loop itself keeps only weak references to tasks).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

_background: set[asyncio.Task] = set()


def spawn(coro) -> None:
    """Run coro in the background, referenced until it is done."""
    task = asyncio.get_running_loop().create_task(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)


async def watch_disconnect(receive, on_disconnect: Callable[[], None]) -> None:
    """Call on_disconnect once the client went away. After the body is read, receive() only
    returns once the client went away (or the response is complete, when this task is cancelled
    anyway)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    on_disconnect()
