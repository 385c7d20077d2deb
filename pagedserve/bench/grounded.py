"""The input-grounded workload of the benches (`bench latency --dataset grounded`, `bench serve
--dataset grounded`): chat prompts asking the model to repeat a piece of Python code with one
change (a renamed function), so that most of the answer copies spans of the prompt — the workload
where n-gram speculation (--speculative-config) pays, as summarising, editing and RAG answers do.

The code: bench/data/grounded_code.json, 16 functions of pagedserve's own source as they were
when the file was written (frozen, so numbers stay comparable). Prompt i uses snippet i mod 16.
No torch; the tokenizer's chat template renders the prompt (model_files/chat_templates.py).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

DATA = Path(__file__).parent / "data" / "grounded_code.json"


@cache
def snippets() -> list[dict]:
    return json.loads(DATA.read_text())


def grounded_message(index: int) -> str:
    """The user message of prompt `index`."""
    snippet = snippets()[index % len(snippets())]
    name = snippet["name"]
    return (f"Repeat the following Python function exactly, with one change: rename `{name}` to "
            f"`{name}_v2`. Answer with the code only.\n\n```python\n{snippet['code']}\n```")


def grounded_token_ids(tokenizer, index: int) -> list[int]:
    """Prompt `index` as token ids, through the tokenizer's chat template (generation prompt added)."""
    from pagedserve.model_files.chat_templates import chat_token_ids
    return chat_token_ids(tokenizer, [{"role": "user", "content": grounded_message(index)}])[0]
