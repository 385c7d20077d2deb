"""POST /v1/embeddings (and /v1/score, /rerank on it) through every service (--runner pooling, issue 38
item 5), driven by the official `openai` client (client.embeddings.create: its default base64 and
float), raw HTTP and
gRPC's Generation/Embed: vectors equal transformers' last_hidden_state pooled the same way
(cosine >= 0.9999, float32), usage counted, a request record kept; a 400 naming the field for
each unsupported field a client commonly sends, and generation endpoints refused as vLLM does."""

from __future__ import annotations

import base64

import grpc
import httpx
import numpy as np
import openai
import pytest
import torch

from pagedserve.v1 import generate_pb2, generate_pb2_grpc

pytestmark = pytest.mark.slow

TEXTS = ["Hello", "The quick brown fox jumps over the lazy dog", "Paged attention keeps the KV cache in blocks. " * 4]


@pytest.fixture(scope="module")
def stack(tiny_model, launch_stack):
    return launch_stack(tiny_model, runner="pooling", pooler="mean", max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def reference(tiny_model):
    """(token ids, mean of last_hidden_state) per text, from transformers."""
    import transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model)
    hf = transformers.AutoModel.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()
    out = []
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        with torch.no_grad():
            out.append((ids, hf(torch.tensor([ids])).last_hidden_state[0].mean(dim=0).numpy()))
    return out


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_openai_client_float_and_base64_equal_transformers(client, model_name, reference):
    as_float = client.embeddings.create(model=model_name, input=TEXTS, encoding_format="float")
    as_default = client.embeddings.create(model=model_name, input=TEXTS)  # the SDK asks for base64
    assert [d.index for d in as_float.data] == [0, 1, 2]
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens == sum(len(ids) for ids, _ in reference)
    for a, b, (_, expected) in zip(as_float.data, as_default.data, reference):
        assert cosine(a.embedding, expected) >= 0.9999
        assert np.isclose(np.linalg.norm(a.embedding), 1.0, atol=1e-5)  # normalised by default
        assert np.allclose(a.embedding, b.embedding, atol=1e-6)
    # token ids, one list or several, as vLLM takes them
    ids = [ids for ids, _ in reference]
    one = client.embeddings.create(model=model_name, input=ids[1], encoding_format="float")
    assert cosine(one.data[0].embedding, reference[1][1]) >= 0.9999
    several = client.embeddings.create(model=model_name, input=ids, encoding_format="float")
    assert all(cosine(d.embedding, e) >= 0.9999 for d, (_, e) in zip(several.data, reference))


def test_raw_base64_unnormalised_and_the_request_record(stack, model_name, reference):
    with httpx.Client(base_url=stack.http_url, timeout=300) as http:
        reply = http.post("/v1/embeddings", json={"model": model_name, "input": TEXTS[2],
                                                  "encoding_format": "base64", "normalize": False})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
        vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
        assert np.allclose(vector, reference[2][1], rtol=1e-4, atol=1e-4)
        record = http.get(f"/v1/requests/{reply.headers['x-request-id']}")
        assert record.status_code == 200 and record.json()["status"] == "finished"


@pytest.mark.parametrize("field, value, words", [
    ("dimensions", 8, "matryoshka"), ("encoding_format", "int8", "float, base64"),
    ("truncate_prompt_tokens", 0, "-1 (the context) or a positive"), ("truncate_prompt_tokens", 5000, "greater than"),
    ("truncate_prompt_tokens", "4", "an integer"), ("input_type", "query", "not supported"),
    ("input", "", "empty"), ("input", [[1, 2], []], "input[1] is empty"), ("normalize", "yes", "true or false")])
def test_unsupported_fields_get_a_400_naming_them(client, model_name, field, value, words):
    body = {"input": "Hello", field: value}
    with pytest.raises(openai.BadRequestError) as err:
        client.post("/embeddings", body={"model": model_name, **body}, cast_to=object)
    assert err.value.body["param"] == field and words in err.value.body["message"]


def test_truncate_prompt_tokens_embeds_each_inputs_last_tokens(client, model_name, reference):
    """vLLM's truncate_prompt_tokens: an input longer than k is embedded as its last k tokens (as
    transformers pools those), a shorter one whole; -1 keeps what the context holds; usage counts
    what was read (the token-id inputs' vectors are transformers', test_openai_client_...)."""
    k = 6
    out = client.embeddings.create(model=model_name, input=TEXTS, encoding_format="float",
                                   extra_body={"truncate_prompt_tokens": k})
    assert out.usage.prompt_tokens == sum(min(k, len(ids)) for ids, _ in reference)
    whole = client.embeddings.create(model=model_name, input=[ids[-k:] for ids, _ in reference],
                                     encoding_format="float")
    for a, b in zip(out.data, whole.data):
        assert np.allclose(a.embedding, b.embedding, atol=1e-6)
    assert cosine(out.data[0].embedding, reference[0][1]) >= 0.9999  # "Hello" is shorter than k: whole
    assert cosine(out.data[2].embedding, reference[2][1]) < 0.999  # cut: not the whole text's vector
    everything = client.embeddings.create(model=model_name, input=TEXTS, encoding_format="float",
                                          extra_body={"truncate_prompt_tokens": -1})
    assert everything.usage.prompt_tokens == sum(len(ids) for ids, _ in reference)
    score = client.post("/score", body={"model": model_name, "text_1": TEXTS[1], "text_2": TEXTS[2],
                                        "truncate_prompt_tokens": k}, cast_to=object)
    want = np.dot(out.data[1].embedding, out.data[2].embedding)
    assert abs(score["data"][0]["score"] - want) < 1e-5 and score["usage"]["prompt_tokens"] == 2 * k


def test_generation_refused_on_a_pooling_server(client, model_name, stack):
    with pytest.raises(openai.BadRequestError, match="does not support Chat Completions API"):
        client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(openai.BadRequestError, match="does not support Completions API"):
        client.completions.create(model=model_name, prompt="Hi")
    with httpx.Client(base_url=stack.http_url, timeout=60) as http:
        reply = http.post("/v1/messages", json={"model": model_name, "max_tokens": 4,
                                                "messages": [{"role": "user", "content": "Hi"}]})
        assert reply.status_code == 400 and "does not support Messages API" in reply.text


def test_grpc_embed(stack, reference):
    with grpc.insecure_channel(stack.grpc_address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        reply = stub.Embed(generate_pb2.EmbedRequest(texts=TEXTS), timeout=300)
        assert reply.usage.prompt_tokens == sum(len(ids) for ids, _ in reference)
        for item, (_, expected) in zip(reply.embeddings, reference):
            assert cosine(item.values, expected) >= 0.9999
        with pytest.raises(grpc.RpcError) as err:
            stub.Embed(generate_pb2.EmbedRequest(texts=["a", ""]), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "texts[1]" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(generate_pb2.GenerateRequest(prompt="Hi"), timeout=60))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "pooling" in err.value.details()


def test_score_and_rerank_are_the_cosines_of_the_embeddings(stack, client, model_name, reference):
    """vLLM's /v1/score and Jina's / Cohere's rerank (as vLLM serves them) on an embedding model: each score
    the cosine of the two texts' /v1/embeddings vectors (and of transformers' pooled states), every distinct
    text embedded once, the documents best first."""
    vectors = [np.asarray(d.embedding, dtype=np.float64)
               for d in client.embeddings.create(model=model_name, input=TEXTS, encoding_format="float").data]
    tokens = sum(len(ids) for ids, _ in reference)
    with httpx.Client(base_url=stack.http_url, timeout=300) as http:
        one_to_many = http.post("/v1/score", json={"model": model_name, "text_1": TEXTS[0], "text_2": TEXTS}).json()
        assert one_to_many["object"] == "list" and one_to_many["usage"]["prompt_tokens"] == tokens  # each text once
        assert [d["index"] for d in one_to_many["data"]] == [0, 1, 2] and one_to_many["data"][0]["object"] == "score"
        for d, v in zip(one_to_many["data"], vectors):
            assert d["score"] == pytest.approx(float(vectors[0] @ v), abs=1e-5)
            assert d["score"] == pytest.approx(cosine(reference[0][1], reference[d["index"]][1]), abs=1e-4)
        pairs = http.post("/score", json={"text_1": [TEXTS[1], TEXTS[2]], "text_2": [TEXTS[2], TEXTS[0]]}).json()
        assert [d["score"] for d in pairs["data"]] == pytest.approx(
            [float(vectors[1] @ vectors[2]), float(vectors[2] @ vectors[0])], abs=1e-5)
        uneven = http.post("/v1/score", json={"text_1": TEXTS[:2], "text_2": TEXTS})
        assert uneven.status_code == 400 and uneven.json()["error"]["param"] == "text_2"

        documents = [TEXTS[2], TEXTS[0], {"text": TEXTS[1]}]
        ranked = http.post("/v1/rerank", json={"model": model_name, "query": TEXTS[1], "documents": documents,
                                                 "top_n": 2}).json()
        scores = [float(vectors[1] @ vectors[i]) for i in (2, 0, 1)]
        best = sorted(range(3), key=lambda i: -scores[i])[:2]
        assert [r["index"] for r in ranked["results"]] == best and best[0] == 2  # the query itself first
        assert ranked["results"][0]["document"] == {"text": TEXTS[1]} and ranked["usage"]["total_tokens"] == tokens
        assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx([scores[i] for i in best], abs=1e-5)
        cohere = http.post("/v2/rerank", json={"query": TEXTS[1], "documents": TEXTS, "return_documents": False})
        assert len(cohere.json()["results"]) == 3 and "document" not in cohere.json()["results"][0]
        for path, body, field in (("/rerank", {"query": "q", "documents": ["d"], "max_tokens_per_doc": 8},
                                   "max_tokens_per_doc"), ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
                                  ("/v1/score", {"text_1": "a", "text_2": [""]}, "text_2"),
                                  ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n")):
            refused = http.post(path, json=body)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text
