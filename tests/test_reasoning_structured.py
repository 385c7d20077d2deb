"""Structured outputs start after the reasoning (issue 38 item 1, vLLM's behaviour): with
StructuredOutput.reasoning_end the grammar reads only what follows it. A tiny model made to write
"hmm, ok</think>" after a prompt (service_stack.bigram_chain_model) keeps its thinking block and
then answers under the regex; without reasoning_end the grammar constrains it from its first
token. Through the engine (the worker's GrammarMatchers), greedy."""

from __future__ import annotations

import pytest

from service_stack import bigram_chain_model
from tiny_models import make_engine

THOUGHT = "hmm, ok</think>"
REGEX = "(yes|no)-[0-9]{2}"


@pytest.fixture(scope="module")
def model(default_model_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("chain-model")
    chain = bigram_chain_model(folder, default_model_path, THOUGHT, "Question:")
    return folder, chain


def run(folder, prompt_ids, reasoning_end: str) -> str:
    from pagedserve.common.sampling_params import SamplingParams, StructuredOutput
    from pagedserve.model_files.tokenizer_files import load_tokenizer

    tokenizer = load_tokenizer(folder)
    engine = make_engine(folder, tokenizer=tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=24,
                            structured_output=StructuredOutput(regex=REGEX, reasoning_end=reasoning_end))
    out = engine.generate([prompt_ids], params)[0][0]
    return tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_the_grammar_starts_after_the_reasoning(model):
    import re
    folder, chain = model
    prompt = [5, 6, chain[0]]  # ends with the chain's start token
    text = run(folder, prompt, "</think>")
    assert text.startswith(THOUGHT)
    assert re.fullmatch(REGEX, text[len(THOUGHT):]), text
    # Without the marker the grammar holds from the first token: no thinking block.
    assert re.fullmatch(REGEX, run(folder, prompt, "")), text
