"""POST /tokenize and /detokenize (vLLM's shapes) and chat-template control against the real
services: a model folder without tokenizer files served with --tokenizer (the default model's)
and --chat-template (a template of the test's, which reads a chat_template_kwargs variable), so
every answer shows which tokenizer and template the tokenizer service used. The public gRPC API
answers the same. And /v1/completions with a list of prompts (strings or token-id lists): the
choices of one batched request equal those of one request per prompt, indexed prompt i sample j
at i * n + j, streamed or not, usage summed. vLLM's return_token_ids (the prompt's ids as the
model read them, the output's as transformers' greedy decoding of the same weights gives them,
whole or chunk by chunk), return_tokens_as_token_ids, truncate_prompt_tokens, allowed_token_ids,
bad_words, chat echo, documents, and use_beam_search (the beams of vLLM's algorithm written out over
transformers' logprobs, test_beam_search.py)."""

from __future__ import annotations

import grpc
import httpx
import pytest

from pagedserve.model_files.tokenizer_files import load_tokenizer
from pagedserve.v1 import generate_pb2, generate_pb2_grpc
from tiny_models import build_tiny_model

pytestmark = pytest.mark.slow

TEMPLATE = ("{% for d in documents or [] %}[doc {{ d.title }}] {{ d.text }}\n{% endfor %}"
            "{% for m in messages %}[{{ m.role }}{% if shout %}!{% endif %}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
CHAT = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def tok(default_model_path):
    return load_tokenizer(default_model_path)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("no-tokenizer")
    return build_tiny_model(folder, vocab_size=49152, max_position_embeddings=1024, eos_token_id=2, pad_token_id=2)


@pytest.fixture(scope="module")
def stack(default_model_path, launch_stack, folder):
    template = folder.parent / "template.jinja"
    template.write_text(TEMPLATE)
    return launch_stack(folder, tokenizer=str(default_model_path), chat_template=str(template))


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.http_url, timeout=60) as client:
        yield client


def test_tokenize_a_prompt(http, tok):
    r = http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True})
    assert r.status_code == 200, r.text
    assert r.json() == {"count": 2, "max_model_len": 1024, "tokens": tok.encode("Hello world"),
                        "token_strs": ["Hello", "Ġworld"]}
    assert http.post("/tokenize", json={"prompt": "Hello"}).json()["token_strs"] is None


def test_chats_go_through_the_operator_template_with_kwargs(http, stack, tok):
    def tokenize(**body):
        r = http.post("/tokenize", json={"messages": CHAT, **body})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    def text(tokens):
        r = http.post("/detokenize", json={"tokens": tokens})
        assert r.status_code == 200, r.text
        return r.json()["prompt"]

    assert text(tokenize()) == "[user] What is 2+2?\n[assistant] "
    assert text(tokenize(chat_template_kwargs={"shout": True})) == "[user!] What is 2+2?\n[assistant] "
    assert text(tokenize(add_generation_prompt=False)) == "[user] What is 2+2?\n"
    partial = CHAT + [{"role": "assistant", "content": "It is"}]
    r = http.post("/tokenize", json={"messages": partial, "add_generation_prompt": False,
                                     "continue_final_message": True})
    assert r.status_code == 200, r.text
    assert text(r.json()["tokens"]) == "[user] What is 2+2?\n[assistant] It is"  # left open

    # A chat completion renders the same prompt as /tokenize does, options included.
    from openai import OpenAI
    client = OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    for extra, tokens in [({}, tokenize()), ({"chat_template_kwargs": {"shout": True}},
                                            tokenize(chat_template_kwargs={"shout": True}))]:
        reply = client.chat.completions.create(model="", messages=CHAT, max_tokens=2, temperature=0,
                                               extra_body=extra)
        assert reply.usage.prompt_tokens == len(tokens)


def test_bad_requests_are_named(http):
    cases = [
        ({"prompt": "hi", "model": "other"}, 404, "other"),
        ({}, 400, "exactly one of 'prompt'"),
        ({"messages": CHAT, "continue_final_message": True}, 400, "cannot both be true"),
        ({"messages": CHAT, "add_generation_prompt": False, "continue_final_message": True}, 400,
         "last message to be the assistant's"),
        ({"messages": CHAT, "chat_template_kwargs": {"messages": []}}, 400, "may not set messages"),
    ]
    for body, status, message in cases:
        r = http.post("/tokenize", json=body)
        assert r.status_code == status and message in r.json()["error"]["message"], (body, r.text)
    r = http.post("/detokenize", json={"tokens": [1, 10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert "tokens[1] = 1000000 is out of range" in r.json()["error"]["message"]
    r = http.post("/detokenize", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400


def test_the_public_grpc_api_tokenizes_too(stack, http, tok):
    with grpc.insecure_channel(stack.grpc_address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        r = stub.Tokenize(generate_pb2.TokenizeRequest(prompt="Hello world", return_token_strs=True), timeout=30)
        assert list(r.token_ids) == tok.encode("Hello world") and r.max_model_len == 1024
        assert list(r.token_strs) == ["Hello", "Ġworld"]
        chat = generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(**m) for m in CHAT],
                                         add_generation_prompt=True, chat_template_kwargs='{"shout": true}')
        r = stub.Tokenize(generate_pb2.TokenizeRequest(chat=chat), timeout=30)
        assert r.text == "[user!] What is 2+2?\n[assistant] "
        assert list(r.token_ids) == http.post("/tokenize", json={"messages": CHAT, "chat_template_kwargs":
                                                                 {"shout": True}}).json()["tokens"]
        d = stub.Detokenize(generate_pb2.DetokenizeRequest(token_ids=r.token_ids), timeout=30)
        assert d.text == r.text
        with pytest.raises(grpc.RpcError) as err:
            stub.Detokenize(generate_pb2.DetokenizeRequest(token_ids=[10**6]), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as err:
            stub.Tokenize(generate_pb2.TokenizeRequest(prompt="x", model="other"), timeout=30)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


PROMPTS = ["Hello", "The quick brown fox jumps over", "Once upon a time, in a land far away, there lived a"]


@pytest.fixture(scope="module")
def client(stack):
    from openai import OpenAI
    return OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def singles(client, prompts, **params):
    return [client.completions.create(model="", prompt=p, max_tokens=6, **params) for p in prompts]


def test_a_list_of_prompts_equals_one_request_each(client, tok):
    for params in ({"temperature": 0}, {"temperature": 1.0, "seed": 7, "n": 2}):
        n = params.get("n", 1)
        alone = singles(client, PROMPTS, **params)
        batch = client.completions.create(model="", prompt=PROMPTS, max_tokens=6, **params)
        assert [c.index for c in batch.choices] == list(range(len(PROMPTS) * n))
        assert [(c.text, c.finish_reason) for c in batch.choices] == \
            [(c.text, c.finish_reason) for one in alone for c in one.choices]
        assert batch.usage.prompt_tokens == sum(one.usage.prompt_tokens for one in alone)
        assert batch.usage.completion_tokens == sum(one.usage.completion_tokens for one in alone)
        # Token-id lists give the same as the strings they encode.
        ids = client.completions.create(model="", prompt=[tok.encode(p) for p in PROMPTS], max_tokens=6, **params)
        assert [c.text for c in ids.choices] == [c.text for c in batch.choices]
    assert len({len(tok.encode(p)) for p in PROMPTS}) == 3  # three different lengths


def test_a_list_of_prompts_streams_the_same_choices(client):
    params = {"temperature": 1.0, "seed": 7, "n": 2, "max_tokens": 6}
    batch = client.completions.create(model="", prompt=PROMPTS, **params)
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    ids, usage = set(), None
    for chunk in client.completions.create(model="", prompt=PROMPTS, stream=True,
                                           stream_options={"include_usage": True}, **params):
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert len(ids) == 1
    assert [texts[i] for i in sorted(texts)] == [c.text for c in batch.choices]
    assert [finish[i] for i in sorted(finish)] == [c.finish_reason for c in batch.choices]
    assert (usage.prompt_tokens, usage.completion_tokens) == (batch.usage.prompt_tokens, batch.usage.completion_tokens)


def test_bad_prompt_lists_are_refused_whole(http):
    cases = [({"prompt": ["a", [1, 2]]}, "prompt"),  # a mix: the request's schema refuses it
             ({"prompt": [[1, 2], []]}, "prompt[1]: prompt must not be empty"),
             ({"prompt": ["a"] * 257}, "at most 256"),
             ({"prompt": ["a", "b"], "top_p": 7}, "top_p")]
    for body, message in cases:
        r = http.post("/v1/completions", json={"max_tokens": 2, **body})
        assert r.status_code == 400 and message in r.json()["error"]["message"], (body, r.text)


def test_a_prompt_refused_downstream_cancels_the_others(http, stack):
    from service_stack import scheduler_stats, wait_until_idle
    before = scheduler_stats(stack).generation_tokens_total
    # The second prompt is over the context (1024 tokens): the scheduler refuses it, by which time
    # the first, asked for 900 tokens, is running; it is aborted, not left to finish.
    r = http.post("/v1/completions", json={"prompt": ["Hello", "hello " * 1100], "max_tokens": 900,
                                           "ignore_eos": True, "temperature": 0})
    assert r.status_code == 400 and "1024" in r.json()["error"]["message"], r.text
    stats = wait_until_idle(stack)
    assert stats.num_running == stats.num_waiting == 0
    assert stats.generation_tokens_total - before < 900


# ---- vLLM's return_token_ids and return_tokens_as_token_ids ------------------------------------
@pytest.fixture(scope="module")
def hf_model(folder):
    import torch
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def greedy(hf_model):
    """Transformers' greedy continuation of prompt ids on the served weights (float32, EOS ignored),
    with vLLM's allowed_token_ids and bad-word sequences applied when given (test_bad_words.py)."""
    from test_bad_words import masked_greedy

    def run(ids: list[int], steps: int, **masks) -> list[int]:
        return masked_greedy(hf_model, ids, steps, **masks)
    return run


def test_return_token_ids_gives_the_prompt_as_read_and_transformers_greedy_ids(client, http, greedy):
    extra = {"return_token_ids": True, "ignore_eos": True}
    prompt_ids = http.post("/tokenize", json={"messages": CHAT}).json()["tokens"]
    want = greedy(prompt_ids, 8)
    chat = client.chat.completions.create(model="", messages=CHAT, max_tokens=8, temperature=0, extra_body=extra)
    assert chat.prompt_token_ids == prompt_ids and chat.choices[0].token_ids == want
    text = http.post("/detokenize", json={"tokens": want}).json()["prompt"]
    assert chat.choices[0].message.content == text
    # Streamed: the prompt's ids once, on the role chunk; every chunk its own ids, which add up.
    chunks = list(client.chat.completions.create(model="", messages=CHAT, max_tokens=8, temperature=0, stream=True,
                                                 extra_body=extra))
    assert chunks[0].prompt_token_ids == prompt_ids and chunks[0].choices[0].delta.role == "assistant"
    assert all(getattr(c, "prompt_token_ids", None) is None for c in chunks[1:])
    assert [t for c in chunks[1:] for t in c.choices[0].token_ids] == want
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text

    ids = [tok for tok in prompt_ids[:5]]
    want = greedy(ids, 6)
    out = client.completions.create(model="", prompt=ids, max_tokens=6, temperature=0, extra_body=extra)
    assert out.choices[0].prompt_token_ids == ids and out.choices[0].token_ids == want
    chunks = list(client.completions.create(model="", prompt=ids, max_tokens=6, temperature=0, stream=True,
                                            extra_body=extra))
    assert chunks[0].choices[0].prompt_token_ids == ids
    assert all(getattr(c.choices[0], "prompt_token_ids", None) is None for c in chunks[1:])
    assert [t for c in chunks for t in c.choices[0].token_ids] == want


def test_return_token_ids_for_every_sample_and_every_prompt_of_a_batch(client, tok):
    params = {"temperature": 1.0, "seed": 7, "n": 2, "max_tokens": 5,
              "extra_body": {"return_token_ids": True, "ignore_eos": True}}
    batch = client.completions.create(model="", prompt=PROMPTS, **params)
    assert [c.prompt_token_ids for c in batch.choices] == [tok.encode(p) for p in PROMPTS for _ in range(2)]
    assert all(len(c.token_ids) == 5 for c in batch.choices)
    streamed: dict[int, list[int]] = {}
    prompts: dict[int, list[list[int]]] = {}
    for chunk in client.completions.create(model="", prompt=PROMPTS, stream=True, **params):
        for c in chunk.choices:
            streamed.setdefault(c.index, []).extend(c.token_ids)
            if getattr(c, "prompt_token_ids", None) is not None:
                prompts.setdefault(c.index, []).append(c.prompt_token_ids)
    assert [streamed[i] for i in range(6)] == [c.token_ids for c in batch.choices]
    assert [prompts[i] for i in range(6)] == [[c.prompt_token_ids] for c in batch.choices]  # once per sample


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(client, http):
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": True}
    chat = client.chat.completions.create(model="", messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                          top_logprobs=2, extra_body=extra)
    (choice,) = chat.choices
    assert [e.token for e in choice.logprobs.content] == [f"token_id:{t}" for t in choice.token_ids]
    assert all(e.bytes == list(e.token.encode()) for e in choice.logprobs.content)
    assert all(t.token.startswith("token_id:") for e in choice.logprobs.content for t in e.top_logprobs)
    assert choice.logprobs.content[0].top_logprobs[0].token == choice.logprobs.content[0].token  # greedy: the best
    out = client.completions.create(model="", prompt="Hello", max_tokens=4, temperature=0, logprobs=1, echo=True,
                                    extra_body=extra)
    (c,) = out.choices
    assert c.logprobs.tokens == [f"token_id:{t}" for t in c.prompt_token_ids + c.token_ids]
    assert all(set(top) <= {f"token_id:{i}" for i in range(49152)} for top in c.logprobs.top_logprobs[1:])
    # Unasked, the bytes are OpenAI's: no ids, tokens as text.
    plain = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3, "temperature": 0,
                                                    "logprobs": True}).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    assert not plain["choices"][0]["logprobs"]["content"][0]["token"].startswith("token_id:")
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "stream": True})
    assert "token_ids" not in r.text


def test_truncate_prompt_tokens_reads_the_prompts_end(client, http, tok, greedy):
    """vLLM's truncate_prompt_tokens: the model reads the prompt's last k tokens (a chat's after its
    template), generates from them as transformers does, counts them in usage and echoes them."""
    text = PROMPTS[2]
    ids = tok.encode(text)
    extra = {"truncate_prompt_tokens": 4, "return_token_ids": True, "ignore_eos": True}
    out = client.completions.create(model="", prompt=text, max_tokens=5, temperature=0, echo=True, extra_body=extra)
    (choice,) = out.choices
    assert choice.prompt_token_ids == ids[-4:] and out.usage.prompt_tokens == 4
    assert choice.token_ids == greedy(ids[-4:], 5)
    tail = http.post("/detokenize", json={"tokens": ids[-4:]}).json()["prompt"]
    assert choice.text.startswith(tail) and not choice.text.startswith(text)
    short = client.completions.create(model="", prompt="Hello", max_tokens=2, temperature=0, echo=True,
                                      extra_body=extra)
    assert short.choices[0].prompt_token_ids == tok.encode("Hello") and short.choices[0].text.startswith("Hello")
    templated = http.post("/tokenize", json={"messages": CHAT}).json()["tokens"]
    chat = client.chat.completions.create(model="", messages=CHAT, max_tokens=3, temperature=0, extra_body=extra)
    assert chat.prompt_token_ids == templated[-4:] and chat.choices[0].token_ids == greedy(templated[-4:], 3)
    whole = client.chat.completions.create(model="", messages=CHAT, max_tokens=3, temperature=0,
                                           extra_body={**extra, "truncate_prompt_tokens": -1})
    assert whole.prompt_token_ids == templated
    for value, words in ((0, "-1 (the context) or a positive"), (-2, "-1 (the context)"), (1025, "greater than")):
        r = http.post("/v1/completions", json={"prompt": text, "max_tokens": 2, "truncate_prompt_tokens": value})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
        assert words in r.json()["error"]["message"]


def test_allowed_token_ids_and_bad_words_decode_as_transformers_masked(client, http, tok, greedy):
    from pagedserve.common.bad_words import token_sequences
    extra = {"return_token_ids": True, "ignore_eos": True}
    prompt_ids = http.post("/tokenize", json={"messages": CHAT}).json()["tokens"]
    plain = client.chat.completions.create(model="", messages=CHAT, max_tokens=8, temperature=0,
                                           extra_body=extra).choices[0].token_ids
    allowed = tok.encode(" yes no maybe") + plain[3:5]
    chat = client.chat.completions.create(model="", messages=CHAT, max_tokens=8, temperature=0,
                                          extra_body={**extra, "allowed_token_ids": allowed})
    assert chat.choices[0].token_ids == greedy(prompt_ids, 8, allowed=allowed) != plain
    assert set(chat.choices[0].token_ids) <= set(allowed)
    def sequences_of(word):
        return token_sequences([word], lambda text: tok.encode(text, add_special_tokens=False))
    # a generated token that is a word of its own (as written or after a space)
    word = next(w for t in plain if (w := tok.decode([t]).strip()) and [t] in sequences_of(w))
    sequences = sequences_of(word)
    banned = client.chat.completions.create(model="", messages=CHAT, max_tokens=8, temperature=0,
                                            extra_body={**extra, "bad_words": [word]}).choices[0].token_ids
    assert banned == greedy(prompt_ids, 8, sequences=sequences) != plain
    out = client.completions.create(model="", prompt=prompt_ids, max_tokens=8, temperature=0,
                                    extra_body={**extra, "bad_words": [word], "allowed_token_ids": allowed})
    assert out.choices[0].token_ids == greedy(prompt_ids, 8, allowed=allowed, sequences=sequences)
    for body, param, words in (({"allowed_token_ids": []}, "allowed_token_ids", "non-empty"),
                               ({"allowed_token_ids": [3, 49152]}, "allowed_token_ids", "outside the vocabulary"),
                               ({"bad_words": [" "]}, "bad_words", "a non-blank string"),
                               ({"bad_words": ["no"] * 101}, "bad_words", "at most 100")):
        r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        assert words in r.json()["error"]["message"]


def test_chat_echo_starts_the_answer_with_the_assistants_message(client, http):
    """vLLM's chat echo: continuing an assistant message, the answer's content starts with it (whole
    and streamed, every sample); after a user message there is nothing to echo."""
    partial = CHAT + [{"role": "assistant", "content": "It is"}]
    params = {"model": "", "messages": partial, "max_tokens": 6, "temperature": 0, "n": 2}
    options = {"add_generation_prompt": False, "continue_final_message": True}
    plain = client.chat.completions.create(**params, extra_body=options)
    echoed = client.chat.completions.create(**params, extra_body={**options, "echo": True})
    assert [c.message.content for c in echoed.choices] == ["It is" + c.message.content for c in plain.choices]
    texts: dict[int, str] = {}
    for chunk in client.chat.completions.create(**params, stream=True, extra_body={**options, "echo": True}):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert [texts[i] for i in range(2)] == [c.message.content for c in echoed.choices]
    user_last = client.chat.completions.create(model="", messages=CHAT, max_tokens=4, temperature=0,
                                               extra_body={"echo": True})
    assert user_last.choices[0].message.content == client.chat.completions.create(
        model="", messages=CHAT, max_tokens=4, temperature=0).choices[0].message.content


def test_documents_reach_the_chat_template(client, http):
    """vLLM's documents: the template's `documents` variable (RAG templates render them); set twice
    (also in chat_template_kwargs) is a 400 naming it."""
    docs = [{"title": "a", "text": "Paris is in France."}, {"title": "b", "text": "Berlin is in Germany."}]
    out = client.chat.completions.create(model="", messages=CHAT, max_tokens=2, temperature=0,
                                         extra_body={"documents": docs, "return_token_ids": True})
    text = http.post("/detokenize", json={"tokens": out.prompt_token_ids}).json()["prompt"]
    assert text == "[doc a] Paris is in France.\n[doc b] Berlin is in Germany.\n[user] What is 2+2?\n[assistant] "
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "documents": docs,
                                                 "chat_template_kwargs": {"documents": []}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents", r.text
    # More than chat_template_kwargs may carry (64 KiB): a RAG request's documents, read to its context's end
    many = [{"title": str(i), "text": "Paged attention keeps the KV cache in blocks. " * 20} for i in range(100)]
    out = client.chat.completions.create(model="", messages=CHAT, max_tokens=2, temperature=0,
                                         extra_body={"documents": many, "truncate_prompt_tokens": 1000})
    assert out.usage.prompt_tokens == 1000


def test_use_beam_search_answers_the_best_beams(client, http, tok, hf_model):
    from test_beam_search import reference
    prompt = tok.encode(PROMPTS[1])
    eos = tok.eos_token_id
    # (no EOS comes among these random weights' candidates, so every beam is as long as the others and
    # length_penalty cannot reorder them here: test_beam_search.py covers EOS and the penalty)
    for n, penalty in ((3, 1.0), (2, 0.5)):
        want = reference(hf_model, prompt, n, 5, eos, penalty)
        texts = [http.post("/detokenize", json={"tokens": [t for t in tokens[len(prompt):] if t != eos]})
                 .json()["prompt"] for tokens, _ in want]
        out = client.completions.create(model="", prompt=prompt, n=n, max_tokens=5, temperature=0,
                                        extra_body={"use_beam_search": True, "length_penalty": penalty})
        assert [c.text for c in out.choices] == texts and [c.index for c in out.choices] == list(range(n))
        assert out.usage.prompt_tokens == len(prompt)
        assert out.usage.completion_tokens == sum(len(tokens) - len(prompt) for tokens, _ in want)
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model="", prompt=prompt, n=3, max_tokens=5, temperature=0, stream=True,
                                           extra_body={"use_beam_search": True}):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == [c.text for c in client.completions.create(
        model="", prompt=prompt, n=3, max_tokens=5, temperature=0, extra_body={"use_beam_search": True}).choices]
    # a chat: the template's prompt, then the same search
    templated = http.post("/tokenize", json={"messages": CHAT}).json()["tokens"]
    want = reference(hf_model, templated, 2, 4, eos)
    chat = client.chat.completions.create(model="", messages=CHAT, n=2, max_tokens=4, temperature=0,
                                          extra_body={"use_beam_search": True})
    assert [c.message.content for c in chat.choices] == [
        http.post("/detokenize", json={"tokens": [t for t in tokens[len(templated):] if t != eos]}).json()["prompt"]
        for tokens, _ in want]
    # pagedserve's timeout bounds the whole search
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 200, "n": 4, "use_beam_search": True,
                                           "timeout": 0.05})
    assert r.status_code == 504 and r.json()["error"]["param"] == "timeout", r.text
    for body, param in (({"logprobs": 2}, "logprobs"), ({"n": 11}, "n"), ({"stop": ["x"]}, "stop")):
        r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "use_beam_search": True, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
