"""Tensor parallelism in the services (`serve --tensor-parallel-size 2`, two worker processes): the
same greedy text as one rank in process, each rank holding about half the weights. In-process
engines: tests/test_tensor_parallel.py."""

from __future__ import annotations

import grpc
import pytest

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.v1 import worker_pb2, worker_pb2_grpc
from service_stack import start_test_stack, tiny_model_with_tokenizer
from tiny_models import make_engine


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_services_with_two_worker_ranks(arch, default_model_path, tmp_path_factory):
    """`serve --tensor-parallel-size 2`: two worker processes, the scheduler steps both; the text
    equals one rank's and each rank reports about half the weights (DeepSeek: MoE and latent
    attention over gRPC and gloo)."""
    import openai

    model = tiny_model_with_tokenizer(tmp_path_factory.mktemp(f"tp-tok-{arch}"), default_model_path, arch)
    prompt = "The capital of France is"
    with make_engine(model, tokenizer=None) as engine:
        [[expected]] = engine.generate([engine.tokenizer.encode(prompt)], SamplingParams(temperature=0, max_tokens=12))
        text = engine.tokenizer.decode(expected.token_ids, skip_special_tokens=True)
        bytes_one = engine.runner.weight_bytes()
    stack = start_test_stack(model, tmp_path_factory.mktemp("tp-logs"), tensor_parallel_size=2)
    try:
        client = openai.OpenAI(base_url=stack.addresses["http"] + "/v1", api_key="unused", max_retries=0)
        reply = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, temperature=0,
                                          max_tokens=12)
        assert reply.choices[0].text == text
        for rank in (0, 1):
            with grpc.insecure_channel(stack.addresses[f"worker{rank}"]) as channel:
                info = worker_pb2_grpc.WorkerStub(channel).Describe(worker_pb2.DescribeRequest(), timeout=10)
            assert (info.rank, info.world_size) == (rank, 2)
            assert 0.45 < info.weight_bytes / bytes_one < (0.62 if arch == "deepseek_v3" else 0.55)
    finally:
        stack.stop()
