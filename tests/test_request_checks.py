"""The request checks against the served model (pagedserve/common/request_checks.py), each written
once and called by the gateway's REST and gRPC paths, the scheduler service and the scheduler core."""

from pagedserve.common import request_checks as checks
from pagedserve.gateway.protocol import ChatCompletionRequest, CompletionRequest, chat_to_generate, \
    completion_to_generate


def test_prompts_are_bounded_in_characters_before_tokenization():
    fits = completion_to_generate(CompletionRequest(prompt="a" * (100 * checks.MAX_CHARS_PER_TOKEN)))
    assert checks.prompt_chars_problem(fits, 100) is None
    over = completion_to_generate(CompletionRequest(prompt="a" * (100 * checks.MAX_CHARS_PER_TOKEN + 1)))
    assert "6401 characters" in checks.prompt_chars_problem(over, 100)
    chat = chat_to_generate(ChatCompletionRequest(messages=[{"role": "user", "content": "a" * 6400}]))
    assert "6404 characters" in checks.prompt_chars_problem(chat, 100)  # the role counts too


def test_max_tokens_alone_against_the_context_names_the_field():
    assert checks.max_tokens_problem(None, 100) is None
    assert checks.max_tokens_problem(100, 100) is None
    assert checks.max_tokens_problem(101, 100, "max_completion_tokens") == (
        "max_completion_tokens=101 exceeds the model's maximum context length of 100 tokens")


def test_a_tokenized_prompt_needs_room_for_one_output_token():
    assert checks.prompt_tokens_problem(0, 10) == "the prompt is empty: at least one token is needed"
    assert checks.prompt_tokens_problem(9, 10) is None
    assert "has 10 tokens" in checks.prompt_tokens_problem(10, 10)


def test_prompt_plus_max_tokens_against_the_context():
    assert checks.output_room_problem(5, None, 10) is None
    assert checks.output_room_problem(5, 5, 10) is None
    assert checks.output_room_problem(5, 6, 10) == ("this model's maximum context length is 10 tokens; the request "
                                                    "asks for 11 (5 in the prompt, 6 in max_tokens)")


def test_token_ids_against_the_vocabulary():
    assert checks.prompt_ids_problem([0, 9], 10) is None
    assert checks.prompt_ids_problem([0, 12, 10], 10) == "prompt token id 12 is outside the vocabulary [0, 10)"
    assert checks.logit_bias_problem(None, 10) is None
    assert checks.logit_bias_problem({3: 1.0, 9: -1.0}, 10) is None
    assert checks.logit_bias_problem({12: 1.0, 10: 2.0, 1: 0.0}, 10) == (
        "logit_bias token id 10 is outside the vocabulary [0, 10)")  # the lowest, as before


def test_a_request_names_the_served_model_or_none():
    assert not checks.other_model("", "gemma") and not checks.other_model(None, "gemma")
    assert not checks.other_model("gemma", "gemma")
    assert checks.other_model("llama", "gemma") and checks.other_model("Gemma", "gemma")


def test_tokens_in_flight_estimate():
    from pagedserve.common.inflight import tokens_in_flight
    assert tokens_in_flight(10, 2, 5, unset_output=256) == 20
    assert tokens_in_flight(10, 2, None, unset_output=256) == 10 + 512  # the router's estimate
    assert tokens_in_flight(10, 1, None, unset_output=90, max_output=100) == 100  # admission: up to the context
    assert tokens_in_flight(10, 1, 500, unset_output=90, max_output=100) == 110
    assert tokens_in_flight(10, 0, 5, unset_output=0, cached_tokens=10) == 1 + 5  # at least 1 and n >= 1


def test_logprobs_against_the_servers_bound():
    from pagedserve.common.sampling_params import SamplingParams
    from pagedserve.v1 import common_pb2, generate_pb2
    assert checks.logprobs_limit(20, 32000) == 20 and checks.logprobs_limit(-1, 32000) == 32000
    assert checks.logprobs_limit(50, 40) == 40  # never past the vocabulary
    assert checks.logprobs_problem(SamplingParams(logprobs=20, prompt_logprobs=20), 20) is None
    assert checks.logprobs_problem(SamplingParams(logprobs=3, prompt_logprobs=21), 20).startswith("prompt_logprobs 21")
    assert checks.logprobs_problem(common_pb2.SamplingParams(logprobs=21), 20).startswith("logprobs 21")
    assert checks.logprobs_problem(common_pb2.SamplingParams(), 0) is None  # unset fields ask for nothing
    info = generate_pb2.ModelInfo()
    assert checks.served_logprobs_limit(info) == 20
    info.max_logprobs = 0
    assert checks.served_logprobs_limit(info) == 0
