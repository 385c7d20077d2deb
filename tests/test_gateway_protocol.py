"""The gateway's pure parts: OpenAI request -> GenerateRequest, validation, response shapes."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pagedserve.common.sampling_params import MAX_LOGPROBS, MAX_N
from pagedserve.v1 import common_pb2, generate_pb2
from pagedserve.gateway.protocol import (ChatCompletionRequest, CompletionRequest, RequestError, chat_to_generate,
                                       completion_to_generate, include_usage)
from pagedserve.gateway.logprobs import CompletionLogprobs, chat_logprobs
from pagedserve.gateway.responses import ChunkBuilder, Collector

FULL = dict(max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=0.5,
            frequency_penalty=-0.5, repetition_penalty=1.2, seed=1234, stop=["\n", "END"], stop_token_ids=[2, 3],
            n=3, ignore_eos=True, min_tokens=2, include_stop_str_in_output=True, skip_special_tokens=False,
            user="someone", priority=-4)


def completion(**kw) -> generate_pb2.GenerateRequest:
    return completion_to_generate(CompletionRequest(**{"prompt": "hi", **kw}))


def chat(**kw) -> generate_pb2.GenerateRequest:
    return chat_to_generate(ChatCompletionRequest(**{"messages": [{"role": "user", "content": "hi"}], **kw}))


def error_of(fn, **kw) -> RequestError:
    with pytest.raises(RequestError) as info:
        fn(**kw)
    return info.value


# ---- request mapping ------------------------------------------------------------------------
def test_every_sampling_parameter_maps():
    gen = completion(**FULL, logprobs=5)
    p = gen.params
    assert (p.max_tokens, p.n, p.top_k, p.seed, p.min_tokens, p.logprobs) == (7, 3, 40, 1234, 2, 5)
    assert p.temperature == 0.5 and p.top_p == pytest.approx(0.9) and p.min_p == pytest.approx(0.05)
    assert p.presence_penalty == 0.5 and p.frequency_penalty == -0.5 and p.repetition_penalty == pytest.approx(1.2)
    assert list(p.stop_token_ids) == [2, 3] and p.ignore_eos
    assert list(gen.stop) == ["\n", "END"] and gen.include_stop_str_in_output and not gen.skip_special_tokens
    assert gen.priority == -4 and gen.prompt == "hi" and not gen.echo


def test_unsent_optional_fields_stay_unset():
    p = chat().params
    for name in ("temperature", "top_p", "repetition_penalty", "seed", "max_tokens", "logprobs"):
        assert not p.HasField(name), name
    assert p.n == 1 and p.top_k == 0 and p.min_p == 0 and not p.ignore_eos
    gen = chat()
    assert gen.skip_special_tokens and gen.model == "" and gen.chat.add_generation_prompt


def test_completions_default_to_16_tokens_like_openai_and_greedy_zero_is_kept():
    p = completion(temperature=0).params
    assert p.max_tokens == 16 and p.HasField("temperature") and p.temperature == 0.0
    assert not completion(max_tokens=None).params.HasField("max_tokens")


def test_prompt_forms():
    assert completion(prompt="text").prompt == "text"
    assert completion(prompt=["one"]).prompt == "one"
    assert list(completion(prompt=[1, 2, 3]).prompt_token_ids.ids) == [1, 2, 3]
    assert list(completion(prompt=[[4, 5]]).prompt_token_ids.ids) == [4, 5]
    assert error_of(completion, prompt=["a", "b"]).param == "prompt"
    assert error_of(completion, prompt=[]).status == 400
    assert error_of(completion, prompt=[1, -2]).param == "prompt"
    assert completion(prompt="x", echo=True).echo


def test_chat_messages_and_parts():
    gen = chat(messages=[{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                         {"role": "assistant", "content": None}], add_generation_prompt=False)
    assert [(m.role, m.content) for m in gen.chat.messages] == [("system", "be brief"), ("user", "a\nb"),
                                                                  ("assistant", "")]
    assert not gen.chat.add_generation_prompt
    err = error_of(chat, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    assert err.status == 400 and "image_url" in err.message and err.param == "messages"
    assert "role" in error_of(chat, messages=[{"role": "robot", "content": "x"}]).message
    assert error_of(chat, messages=[]).param == "messages"


def test_chat_max_completion_tokens_wins_and_logprobs():
    assert chat(max_tokens=5).params.max_tokens == 5
    assert chat(max_tokens=5, max_completion_tokens=9).params.max_tokens == 9
    assert chat(logprobs=True).params.logprobs == 0
    assert chat(logprobs=True, top_logprobs=3).params.logprobs == 3
    assert not chat(logprobs=False).params.HasField("logprobs")
    assert error_of(chat, top_logprobs=2).param == "top_logprobs"
    assert error_of(chat, logprobs=True, top_logprobs=-1).param == "top_logprobs"
    assert chat(logprobs=True, top_logprobs=MAX_LOGPROBS + 1).params.logprobs == MAX_LOGPROBS + 1  # the server's bound
    assert error_of(chat, max_completion_tokens=0).param == "max_completion_tokens"


def test_stop_string_forms():
    assert list(completion(stop="x").stop) == ["x"]
    assert list(completion().stop) == []
    assert error_of(completion, stop=["a", ""]).param == "stop"


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5),
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0.0), ("max_tokens", 0),
    ("n", 0), ("n", MAX_N + 1), ("logprobs", -1), ("stop_token_ids", [-1]),
    ("min_tokens", 99)])
def test_invalid_parameters_are_400_naming_the_field(field, value):
    err = error_of(completion, **{field: value, "max_tokens": 10} if field != "max_tokens" else {field: value})
    assert err.status == 400 and err.param == field and field in err.message and err.type == "invalid_request_error"
    assert err.body() == {"error": {"message": err.message, "type": "invalid_request_error", "param": field,
                                    "code": None}}


def test_unsupported_features_are_refused():
    assert error_of(completion, best_of=3).param == "best_of"
    assert error_of(completion, suffix="x").param == "suffix"
    assert error_of(chat, response_format={"type": "xml"}).param == "response_format"
    assert chat(response_format={"type": "text"}, logit_bias={}, best_of=1).params.n == 1
    with pytest.raises(RequestError):
        completion(max_tokens=2**33)


def test_pydantic_rejects_wrong_types():
    with pytest.raises(ValidationError):
        CompletionRequest(prompt="x", temperature="hot")
    with pytest.raises(ValidationError):
        CompletionRequest(prompt={"a": 1})
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[{"content": "no role"}])


def test_stream_options():
    assert include_usage(CompletionRequest(prompt="x", stream=True, stream_options={"include_usage": True}))
    assert not include_usage(CompletionRequest(prompt="x", stream=True))


# ---- responses ------------------------------------------------------------------------------
def lp(token: str, logprob: float, top: list[tuple[str, float]] = ()) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token_id=1, token=token, logprob=logprob,
                                   top=[common_pb2.TopLogprob(token_id=2, token=t, logprob=v) for t, v in top])


def accepted(prompt_tokens: int = 5, prompt_text: str = "") -> generate_pb2.GenerateResponse:
    return generate_pb2.GenerateResponse(request_id="r", accepted=True, prompt_text=prompt_text,
                                         usage=common_pb2.Usage(prompt_tokens=prompt_tokens))


def delta(index: int, text: str, ids: list[int], finish: str = "", completion_tokens: int = 0,
          logprobs=()) -> generate_pb2.GenerateResponse:
    msg = generate_pb2.GenerateResponse(request_id="r", index=index, text=text, token_ids=ids, finish_reason=finish,
                                        logprobs=list(logprobs))
    if finish:
        msg.usage.CopyFrom(common_pb2.Usage(prompt_tokens=5, completion_tokens=completion_tokens, cached_tokens=2))
        msg.timings.finished = 1.0
    return msg


def test_collector_completion_with_n_and_usage():
    c = Collector(2)
    for msg in (accepted(), delta(0, "Hel", [1]), delta(1, "A", [2]), delta(0, "lo", [3], "stop", 2),
                delta(1, "B", [4, 5], "length", 3)):
        c.add(msg)
    out = c.completion("cmpl-1", "m", 7, logprobs=False, echo=False)
    assert out["object"] == "text_completion" and out["id"] == "cmpl-1" and out["model"] == "m"
    assert [(ch["index"], ch["text"], ch["finish_reason"]) for ch in out["choices"]] == [(0, "Hello", "stop"),
                                                                                        (1, "AB", "length")]
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10,
                            "prompt_tokens_details": {"cached_tokens": 2}}
    chat_out = c.chat("chatcmpl-1", "m", 7, logprobs=False)
    assert chat_out["object"] == "chat.completion"
    assert chat_out["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}


def test_echo_prepends_the_prompt_and_offsets_follow():
    c = Collector(1)
    for msg in (accepted(prompt_text="Say"), delta(0, " hi", [1], "stop", 1, [lp(" hi", -0.5, [(" hi", -0.5)])])):
        c.add(msg)
    assert c.completion("c", "m", 0, logprobs=False, echo=True)["choices"][0]["text"] == "Say hi"
    assert c.completion("c", "m", 0, logprobs=True, echo=True)["choices"][0]["logprobs"]["text_offset"] == [3]


def test_logprob_shapes():
    entries = [lp("a", -0.1, [("a", -0.1), ("b", -2.0)]), lp("é", float("-inf"), [("x", -1.0)])]
    out = chat_logprobs(entries)["content"]
    assert out[0] == {"token": "a", "logprob": -0.1, "bytes": [97],
                      "top_logprobs": [{"token": "a", "logprob": -0.1, "bytes": [97]},
                                       {"token": "b", "logprob": -2.0, "bytes": [98]}]}
    assert out[1]["logprob"] == -9999.0 and out[1]["bytes"] == [0xC3, 0xA9]
    comp = CompletionLogprobs().build(entries)
    assert comp["tokens"] == ["a", "é"] and comp["token_logprobs"] == [-0.1, -9999.0]
    assert comp["top_logprobs"] == [{"a": -0.1, "b": -2.0}, {"x": -1.0, "é": -9999.0}]
    assert comp["text_offset"] == [0, 1]


def test_chat_chunks_role_first_then_deltas_then_finish_and_usage():
    b = ChunkBuilder(True, "chatcmpl-x", "m", 9, n=2, logprobs=True)
    first = b.add(accepted())
    assert [c["choices"][0]["delta"] for c in first] == [{"role": "assistant", "content": ""}] * 2
    assert {c["choices"][0]["index"] for c in first} == {0, 1}
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-x" for c in first)
    (mid,) = b.add(delta(0, "Hi", [1], logprobs=[lp("Hi", -0.2)]))
    assert mid["choices"][0]["delta"] == {"content": "Hi"} and mid["choices"][0]["finish_reason"] is None
    assert mid["choices"][0]["logprobs"]["content"][0]["token"] == "Hi"
    (end,) = b.add(delta(0, "", [], "stop", 1))
    assert end["choices"][0]["delta"] == {} and end["choices"][0]["finish_reason"] == "stop"
    b.add(delta(1, "Yo", [2, 3], "length", 2))
    usage = b.usage_chunk()
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3 and usage["usage"]["prompt_tokens"] == 5


def test_completion_chunks_with_echo_and_offsets():
    b = ChunkBuilder(False, "cmpl-x", "m", 9, n=1, logprobs=False, echo=True)
    (first,) = b.add(accepted(prompt_text="ab"))
    assert first["object"] == "text_completion" and first["choices"][0]["text"] == "ab"
    assert ChunkBuilder(False, "c", "m", 0, 1, False).add(accepted()) == []
    # echo with logprobs: the prompt's text waits for its logprobs (the first message) and goes with them.
    b = ChunkBuilder(False, "cmpl-x", "m", 9, n=1, logprobs=True, echo=True)
    assert b.add(accepted(prompt_text="ab")) == []
    first = delta(0, "cd", [1], logprobs=[lp("cd", -1.0)])
    first.prompt_logprobs.extend([lp("a", 0.0), lp("b", -3.0, [("x", -0.1)])])
    (c1,) = b.add(first)
    (c2,) = b.add(delta(0, "e", [2], "length", 2, logprobs=[lp("e", -1.0)]))
    assert c1["choices"][0]["text"] == "abcd"
    assert c1["choices"][0]["logprobs"]["tokens"] == ["a", "b", "cd"]
    assert c1["choices"][0]["logprobs"]["token_logprobs"] == [None, -3.0, -1.0]
    assert c1["choices"][0]["logprobs"]["top_logprobs"][:2] == [None, {"x": -0.1, "b": -3.0}]
    assert c1["choices"][0]["logprobs"]["text_offset"] == [0, 1, 2]
    assert c2["choices"][0]["logprobs"]["text_offset"] == [4]
    assert c2["choices"][0]["finish_reason"] == "length" and "prompt_logprobs" not in c1["choices"][0]


def test_echo_with_logprobs_covers_the_prompt_and_prompt_logprobs_take_vllms_shape():
    gen = completion(echo=True, logprobs=2, max_tokens=0)
    assert gen.params.prompt_logprobs == 2 and gen.params.max_tokens == 0 and gen.params.logprobs == 2
    assert completion(echo=True, logprobs=2, prompt_logprobs=5).params.prompt_logprobs == 5
    assert completion(prompt_logprobs=0).params.prompt_logprobs == 0
    assert not completion(logprobs=1).params.HasField("prompt_logprobs")
    assert not completion(echo=True).params.HasField("prompt_logprobs")
    assert error_of(completion, prompt_logprobs=-1).param == "prompt_logprobs"
    assert error_of(completion, max_tokens=0).param == "max_tokens"
    assert error_of(completion, echo=True, max_tokens=0, n=2).param == "max_tokens"
    assert error_of(chat, max_tokens=0).param == "max_tokens"
    assert chat(prompt_logprobs=1).params.prompt_logprobs == 1 and not chat().params.HasField("prompt_logprobs")
    assert error_of(chat, prompt_logprobs=-1).param == "prompt_logprobs"
    c = Collector(1)
    first = delta(0, " c", [7], "length", 1, [lp(" c", -0.5)])
    first.prompt_logprobs.extend([common_pb2.TokenLogprob(token_id=4, token="A"),
                                  common_pb2.TokenLogprob(token_id=5, token=" b", logprob=-2.0, rank=3,
                                                          top=[common_pb2.TopLogprob(token_id=9, token=" x",
                                                                                     logprob=-0.25)])])
    for msg in (accepted(prompt_text="A b"), first):
        c.add(msg)
    (choice,) = c.completion("c", "m", 0, logprobs=True, echo=True, prompt_logprobs=True)["choices"]
    assert choice["text"] == "A b c"
    assert choice["logprobs"] == {"tokens": ["A", " b", " c"], "token_logprobs": [None, -2.0, -0.5],
                                  "top_logprobs": [None, {" x": -0.25, " b": -2.0}, {" c": -0.5}],
                                  "text_offset": [0, 1, 3]}
    assert choice["prompt_logprobs"] == [None, {"5": {"logprob": -2.0, "rank": 3, "decoded_token": " b"},
                                                "9": {"logprob": -0.25, "rank": 1, "decoded_token": " x"}}]
    (plain,) = c.completion("c", "m", 0, logprobs=False, echo=False)["choices"]
    assert plain["text"] == " c" and plain["logprobs"] is None and "prompt_logprobs" not in plain


def _messages_of_n2(every_choice: bool) -> list[generate_pb2.GenerateResponse]:
    """An n = 2 completion with prompt logprobs as the tokenizer sends it: once, with choice 0's first
    message (every_choice: as it was, with each choice's first message)."""
    prompt = [lp("A", 0.0), lp(" b", -2.0, [(" x", -0.25)])]
    msgs = [accepted(prompt_text="A b"), delta(0, " c", [7], logprobs=[lp(" c", -0.5)]),
            delta(1, " d", [8], logprobs=[lp(" d", -0.7)]), delta(0, "!", [9], "length", 2, [lp("!", -0.1)]),
            delta(1, "?", [10], "length", 2, [lp("?", -0.2)])]
    for m in (msgs[1], msgs[2]) if every_choice else (msgs[1],):
        m.prompt_logprobs.extend(prompt)
    return msgs


@pytest.mark.parametrize("echo, prompt_logprobs", [(True, False), (False, True), (True, True)])
def test_prompt_logprobs_sent_once_show_in_every_choice_as_before(echo, prompt_logprobs):
    """Issue 42 row 3: the prompt's logprobs come once per request (with choice 0's first message);
    every choice still shows them, whole and streamed, exactly as when each choice's message carried
    a copy."""
    def whole(every_choice):
        c = Collector(2)
        for msg in _messages_of_n2(every_choice):
            c.add(msg)
        return c.completion("c", "m", 0, logprobs=True, echo=echo, prompt_logprobs=prompt_logprobs)

    def streamed(every_choice):
        b = ChunkBuilder(False, "c", "m", 0, 2, logprobs=True, echo=echo, prompt_logprobs=prompt_logprobs)
        return [chunk for msg in _messages_of_n2(every_choice) for chunk in b.add(msg)]

    once, chunks = whole(False), streamed(False)
    assert once == whole(True) and chunks == streamed(True)
    for choice in once["choices"]:
        assert choice["text"].startswith("A b" if echo else " ")
        assert (choice["logprobs"]["tokens"][:2] == ["A", " b"]) == echo
        assert ("prompt_logprobs" in choice) == prompt_logprobs
    firsts = [next(c["choices"][0] for c in chunks if c["choices"][0]["index"] == i) for i in range(2)]
    assert all((f.get("prompt_logprobs") is not None) == prompt_logprobs for f in firsts)
    assert all(f["text"].startswith("A b") == echo for f in firsts)


# ---- input that cannot be encoded or means nothing (issue 13) ---------------------------------
@pytest.mark.parametrize("body, field", [
    ({"prompt": "caf\ud800"}, "prompt"),
    ({"prompt": "x", "stop": ["ok", "\udfff"]}, "stop[1]"),
    ({"prompt": "x", "model": "m\ud800"}, "model"),
    ({"messages": [{"role": "user", "content": "hi \ud83d"}]}, "messages[0].content"),
])
def test_strings_that_are_not_unicode_are_refused_naming_the_field(body, field):
    model = ChatCompletionRequest if "messages" in body else CompletionRequest
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    assert field in str(info.value) and "surrogate" in str(info.value)
    assert model.model_validate({"prompt": "café 😀"} if model is CompletionRequest else
                                {"messages": [{"role": "user", "content": "hi 😀"}]})  # real astral text is fine


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_numbers_are_refused(value):
    with pytest.raises(ValidationError, match="finite"):
        CompletionRequest.model_validate({"prompt": "x", "temperature": value})


def test_an_internal_error_says_nothing_of_the_exception(caplog):
    from pagedserve.gateway.protocol import internal_error
    with caplog.at_level("ERROR", logger="pagedserve.gateway"):
        error = internal_error(ValueError("secret detail of another request"))
    assert error.status == 500 and "secret" not in error.message and "correlation id" in error.message
    correlation = error.message.rsplit(" ", 1)[-1].rstrip(")")
    assert any(correlation in r.getMessage() and "secret detail" in r.getMessage() for r in caplog.records)

