"""Redis for the launcher: a PING probe, and a private, throw-away redis-server on a free loopback
port (no persistence, its files in a temp dir) for a stack given no --redis-url.

Threads: none. Invariants: private_redis returns a server that answered PING, or has stopped it
and removed its temp dir before raising; whoever gets it stops it and removes the dir (Stack.stop
does). No torch; the redis client is imported when first used.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from pagedserve.common.settings import LOOPBACK
from pagedserve.launcher.service_process import ServiceError, ServiceProcess


def redis_ping(url: str, timeout_s: float = 2.0) -> bool:
    import redis
    try:
        client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError, ValueError):
        return False


def private_redis(log_path: str | os.PathLike | None = None) -> tuple[ServiceProcess, str, str]:
    """A throw-away redis-server on a free loopback port, persisting nothing, in a temp dir.
    Returns (process, url, temp dir); started and ready. The caller stops it and removes the dir."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise ServiceError("redis-server is not on the PATH")
    from pagedserve.common.grpc_util import free_port
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="pagedserve-redis-")
    url = f"redis://{LOOPBACK}:{port}/0"
    argv = [exe, "--port", str(port), "--bind", LOOPBACK, "--save", "", "--appendonly", "no",
            "--dir", tmp, "--daemonize", "no", "--loglevel", "warning"]
    proc = ServiceProcess("redis", argv, env=None, log_path=log_path, ready=lambda: redis_ping(url, 0.5),
                          arms_own_death_signal=False)
    try:
        proc.start().wait_healthy(30)
    except BaseException:
        proc.stop(2)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return proc, url, tmp
