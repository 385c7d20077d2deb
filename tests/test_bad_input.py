"""Bad input: a clear error naming what was wrong and the limit, raised at once; the engine
stays usable afterwards."""

from __future__ import annotations

import json
import shutil

import pytest

from pagedserve.common.sampling_params import SamplingParams
from tiny_models import make_engine


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return make_engine(tiny_llama, kv_cache_memory=40 * 8192, max_model_len=300)


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture(tiny_llama, tmp_path):
    folder = copy_model(tiny_llama, tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel.*LlamaForCausalLM"):
        make_engine(folder)


def test_missing_weights(tiny_llama, tmp_path):
    folder = copy_model(tiny_llama, tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights"):
        make_engine(folder)


def test_corrupt_weights(tiny_llama, tmp_path):
    folder = copy_model(tiny_llama, tmp_path / "m")
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(ValueError, match="model.safetensors"):
        make_engine(folder)


def test_missing_model_folder(tmp_path):
    with pytest.raises(FileNotFoundError):
        make_engine(tmp_path / "nowhere")


def test_prompt_longer_than_context(engine):
    with pytest.raises(ValueError, match="300 tokens.*max_model_len.*300"):
        engine.add_request("long", [7] * 300, SamplingParams())


def test_prompt_larger_than_pool(engine):
    small = make_engine(engine.model_path, kv_cache_memory=4 * 8192)  # 4 blocks of 16 tokens
    with pytest.raises(ValueError, match="needs 8 KV blocks.*pool has 4"):
        small.add_request("big", [7] * 120, SamplingParams())


def test_out_of_vocab_and_empty(engine):
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 256\)"):
        engine.add_request("oov", [5, 999], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], SamplingParams())


@pytest.mark.parametrize("kwargs, words", [
    (dict(temperature=-0.5), "temperature"), (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), "top_p"), (dict(top_k=-3), "top_k"), (dict(min_p=2.0), "min_p"),
    (dict(max_tokens=-1), "max_tokens"), (dict(max_tokens=0, n=2), "n=1"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(n=0), "n must be"), (dict(logprobs=-1), "logprobs must be an integer >= 0"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(presence_penalty=3.0), "presence_penalty"),
])
def test_invalid_sampling_values(kwargs, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kwargs)


def test_duplicate_id_and_engine_keeps_working(engine):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("dup", [5, 6, 7], params)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [5, 6, 7], params)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done.setdefault(out.request_id, []).extend(t.token_id for t in out.new_tokens)
    assert len(done["dup"]) == 4
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks


def test_bad_engine_flags(tiny_llama):
    with pytest.raises(ValueError, match="kv-cache-memory|size"):
        make_engine(tiny_llama, kv_cache_memory="lots")
    with pytest.raises(ValueError, match="max_model_len 9999 exceeds the model's context of 512"):
        make_engine(tiny_llama, max_model_len=9999)
    with pytest.raises(ValueError, match="dtype"):
        make_engine(tiny_llama, dtype="int8")
