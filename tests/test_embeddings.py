"""Embeddings in process (LLM.embed with runner="pooling"; issue 38 item 5): each pooler's vector
equals transformers' last_hidden_state pooled the same way (cosine >= 0.9999, float32), whatever
the chunking; normalised unless asked not to; a "last" request takes prefix-cache hits and leaves
no KV held; mean takes none and still matches; refusals worded as the servers'."""

from __future__ import annotations

import math

import pytest
import torch

from service_stack import tiny_model_with_tokenizer

ENGINE_ARGS = dict(dtype="float32", kv_cache_memory="64MiB", runner="pooling")
TEXTS = ["Hello", "The quick brown fox jumps over the lazy dog and then",
         "Once upon a time, in a land far away, there lived a king who had three daughters. The youngest " * 3]


@pytest.fixture(scope="module")
def model(default_model_path, tmp_path_factory):
    return tiny_model_with_tokenizer(tmp_path_factory.mktemp("embed-model"), default_model_path)


@pytest.fixture(scope="module")
def reference(model):
    """(token ids, last_hidden_state) per text, from transformers."""
    import transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    hf = transformers.AutoModel.from_pretrained(model, torch_dtype=torch.float32).eval()
    out = []
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        with torch.no_grad():
            out.append((ids, hf(torch.tensor([ids])).last_hidden_state[0]))
    return out


def pooled(hidden: torch.Tensor, pooler: str) -> torch.Tensor:
    return {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[pooler]


def cosine(a, b) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.tensor(a), b, dim=0))


@pytest.mark.parametrize("pooler", ["last", "mean", "cls"])
def test_each_pooler_equals_transformers_chunked_or_not(model, reference, pooler):
    from pagedserve import LLM, PoolingParams
    # A 16-token step budget: the long prompt runs in chunks (mean sums them, cls keeps the first).
    with LLM(model=str(model), pooler=pooler, max_num_batched_tokens=16, long_prefill_token_threshold=0,
             **ENGINE_ARGS) as llm:
        outs = llm.embed(TEXTS)
        raw = llm.embed(TEXTS, PoolingParams(normalize=False))
    assert len(reference[2][0]) > 40  # it did run in chunks
    for out, plain, (ids, hidden) in zip(outs, raw, reference):
        expected = pooled(hidden, pooler)
        assert out.prompt_token_ids == ids
        assert len(out.outputs.embedding) == hidden.shape[1]
        assert cosine(out.outputs.embedding, expected) >= 0.9999
        assert math.isclose(sum(v * v for v in out.outputs.embedding), 1.0, rel_tol=1e-5)
        assert torch.allclose(torch.tensor(plain.outputs.embedding), expected, rtol=1e-4, atol=1e-4)


def test_last_takes_prefix_hits_and_keeps_no_kv_while_mean_takes_none(model, reference):
    from pagedserve import LLM
    ids, hidden = reference[2]
    for pooler, hits in (("last", True), ("mean", False)):
        with LLM(model=str(model), pooler=pooler, **ENGINE_ARGS) as llm:
            first = llm.embed({"prompt_token_ids": ids})[0].outputs.embedding
            stats = llm.engine.stats()
            assert stats["num_free_blocks"] == stats["num_blocks"]  # nothing held past its step
            second = llm.embed({"prompt_token_ids": ids})[0].outputs.embedding
            assert (llm.engine.stats()["prefix_cache_hits"] > 0) is hits
        assert cosine(first, pooled(hidden, pooler)) >= 0.9999
        assert cosine(second, pooled(hidden, pooler)) >= 0.9999


def test_refusals(model):
    from pagedserve import LLM, PoolingParams
    with LLM(model=str(model), dtype="float32", kv_cache_memory="64MiB") as llm:
        with pytest.raises(ValueError, match="runner='pooling'"):
            llm.embed("Hello")
    with LLM(model=str(model), **ENGINE_ARGS) as llm:
        with pytest.raises(ValueError, match="dimensions"):
            llm.embed("Hello", PoolingParams(dimensions=8))
        with pytest.raises(ValueError, match="prompts\\[1\\] is empty"):
            llm.embed(["Hello", {"prompt_token_ids": []}])
        assert len(llm.embed(["a", "b"])) == 2  # nothing was left behind by the refusals
