"""The model's sampling defaults (common/sampling_defaults.py, vLLM's --generation-config): read from
generation_config.json as vLLM reads them, filled into a request's unset fields only. The tokenizer
service's part: tests/test_tokenizer_service.py; the flags: tests/test_settings.py."""

from __future__ import annotations

import json

import pytest

from pagedserve.common.sampling_defaults import apply_defaults, read_defaults
from pagedserve.common.wire import params_from_proto
from pagedserve.gateway.protocol import CompletionRequest, completion_to_generate
from pagedserve.v1 import common_pb2

QWEN = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
        "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "transformers_version": "4.37.0"}


def folder_with(tmp_path, config: dict, name: str = "model"):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


def test_read_as_vllm_reads_them(tmp_path):
    qwen = folder_with(tmp_path, QWEN)
    want = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    assert read_defaults(qwen) == want
    assert read_defaults(qwen, "vllm") == {}
    assert read_defaults(None, str(qwen)) == want  # another folder's
    assert read_defaults(folder_with(tmp_path, {"eos_token_id": 2}, "plain")) == {}  # SmolLM2's: none
    assert read_defaults(tmp_path / "nothing-here") == {}
    assert read_defaults(qwen, override='{"temperature": 0.2, "max_new_tokens": 64}') == {
        **want, "temperature": 0.2, "max_tokens": 64}
    assert read_defaults(qwen, "vllm", {"top_k": 5}) == {"top_k": 5}
    with pytest.raises(ValueError, match="no generation_config.json"):
        read_defaults(qwen, str(tmp_path / "elsewhere"))
    with pytest.raises(ValueError, match="top_p"):
        read_defaults(folder_with(tmp_path, {"top_p": 1.5}, "bad"))
    with pytest.raises(ValueError, match="max_new_tokens"):
        read_defaults(qwen, override={"max_new_tokens": 0})
    with pytest.raises(ValueError, match="JSON"):
        read_defaults(qwen, override="{temperature: 1")


def test_only_what_the_request_left_unset_takes_them():
    defaults = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05,
                "max_tokens": 32}
    unset = common_pb2.SamplingParams()
    apply_defaults(unset, defaults)
    got = params_from_proto(unset)
    assert (got.temperature, got.top_k, got.max_tokens) == (0.7, 20, 32)
    assert (round(got.top_p, 6), round(got.min_p, 6), round(got.repetition_penalty, 6)) == (0.8, 0.05, 1.05)
    sent = common_pb2.SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
                                     max_tokens=8)
    apply_defaults(sent, defaults)
    assert params_from_proto(sent).greedy and (sent.top_k, sent.min_p, sent.top_p, sent.max_tokens) == (0, 0, 1, 8)
    long = common_pb2.SamplingParams(max_tokens=500)
    apply_defaults(long, defaults)
    assert long.max_tokens == 32  # vLLM's rule: max_new_tokens caps a sent max_tokens too
    embedding = common_pb2.SamplingParams(pooling=common_pb2.Pooling(type="mean"))
    apply_defaults(embedding, defaults)
    assert not embedding.HasField("temperature") and not embedding.HasField("top_k")


def test_the_gateway_leaves_unsent_fields_unset():
    """So that the tokenizer can tell a client's top_k 0 from no top_k at all."""
    gen = completion_to_generate(CompletionRequest(prompt="x", temperature=0.5))
    assert gen.params.HasField("temperature") and not gen.params.HasField("top_k")
    assert not gen.params.HasField("min_p") and not gen.params.HasField("top_p")
    sent = completion_to_generate(CompletionRequest(prompt="x", top_k=0, min_p=0.0))
    assert sent.params.HasField("top_k") and sent.params.HasField("min_p")
