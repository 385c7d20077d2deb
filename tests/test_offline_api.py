"""The offline API (`from pagedserve import LLM, AsyncLLM, SamplingParams`) on a tiny random Llama
that carries the default model's tokenizer: greedy tokens equal to transformers' (float32) and to
`pagedserve generate`'s, several prompts in one call, stop strings, seeded n > 1 sampling, chats
through the template, AsyncLLM streaming, and a package import that loads no torch."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from service_stack import tiny_model_with_tokenizer
from tiny_models import hf_greedy

ROOT = Path(__file__).resolve().parents[1]
ENGINE_ARGS = dict(dtype="float32", kv_cache_memory="64MiB")
PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog and then", "Once upon a time, in a land far away,"
           " there lived a king who had three daughters. The youngest"]


@pytest.fixture(scope="module")
def model(default_model_path, tmp_path_factory) -> Path:
    return tiny_model_with_tokenizer(tmp_path_factory.mktemp("offline-model"), default_model_path)


@pytest.fixture(scope="module")
def llm(model):
    from pagedserve import LLM
    with LLM(model=str(model), **ENGINE_ARGS) as engine:
        yield engine


def greedy(max_tokens: int = 8, **kw):
    from pagedserve import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_the_package_imports_without_torch():
    code = ("import sys, pagedserve; from pagedserve import SamplingParams, RequestOutput; "
            "SamplingParams(stop='x'); print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_several_prompts_give_transformers_greedy_tokens(llm, model):
    outs = llm.generate(PROMPTS, greedy(8))
    tok = llm.get_tokenizer()
    assert [o.prompt for o in outs] == PROMPTS
    assert [o.prompt_token_ids for o in outs] == [tok.encode(p) for p in PROMPTS]
    assert len({len(o.prompt_token_ids) for o in outs}) == 3  # three different lengths in one batch
    expected = hf_greedy(model, [o.prompt_token_ids for o in outs], 8)
    assert [o.outputs[0].token_ids for o in outs] == expected
    for o in outs:
        (sample,) = o.outputs
        assert o.finished and sample.finish_reason == "length" and sample.index == 0
        assert sample.text == tok.decode(sample.token_ids, skip_special_tokens=True)


def test_same_text_as_pagedserve_generate(llm, model, tmp_path):
    from pagedserve.cli import main
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True}) + "\n"
                           for p in PROMPTS))
    assert main(["generate", "--prompts-file", str(src), "--output", str(dst), "--model", str(model),
                 "--dtype", "float32", "--kv-cache-memory", "64MiB"]) == 0
    cli = [json.loads(line)["outputs"][0] for line in dst.read_text().splitlines()]
    ours = [o.outputs[0] for o in llm.generate(PROMPTS, greedy(6))]
    assert [(s.text, s.token_ids) for s in ours] == [(c["text"], c["token_ids"]) for c in cli]


def test_stop_strings_cut_the_text_and_token_ids(llm):
    full = llm.generate(PROMPTS[1], greedy(12))[0].outputs[0]
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
    assert stop.strip(), full.text
    cut = llm.generate(PROMPTS[1], greedy(12, stop=[stop]))[0].outputs[0]
    assert cut.text == full.text[:full.text.index(stop)]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)
    assert cut.token_ids == full.token_ids[:len(cut.token_ids)] and len(cut.token_ids) < 12
    kept = llm.generate(PROMPTS[1], greedy(12, stop=stop, include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == full.text[:full.text.index(stop) + len(stop)]


def test_bad_words_and_allowed_token_ids_as_vllms_sampling_params(llm, model):
    """vLLM's SamplingParams(bad_words=..., allowed_token_ids=...): greedy tokens as transformers'
    with the masks applied (test_bad_words.masked_greedy), the words tokenized as the servers do."""
    import torch
    import transformers
    from pagedserve.common.bad_words import token_sequences
    from test_bad_words import masked_greedy
    tok = llm.get_tokenizer()
    prompt = tok.encode(PROMPTS[1])
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
    plain = llm.generate(PROMPTS[1], greedy(8))[0].outputs[0].token_ids
    word = next(w for t in plain if (w := tok.decode([t]).strip())
                and [t] in token_sequences([w], lambda x: tok.encode(x, add_special_tokens=False)))
    sequences = token_sequences([word], lambda x: tok.encode(x, add_special_tokens=False))
    allowed = sorted(set(plain[2:6]) | set(tok.encode(" and then")))
    out = llm.generate([PROMPTS[1]] * 2, [greedy(8, bad_words=[word]), greedy(8, allowed_token_ids=allowed)])
    assert out[0].outputs[0].token_ids == masked_greedy(hf, prompt, 8, sequences=sequences) != plain
    assert out[1].outputs[0].token_ids == masked_greedy(hf, prompt, 8, allowed=allowed) != plain
    with pytest.raises(ValueError, match="bad_words"):
        greedy(8, bad_words=[""])


def test_structured_outputs_as_vllms_sampling_params(llm):
    """vLLM's SamplingParams(structured_outputs=StructuredOutputsParams(...)) and its older
    guided_decoding=GuidedDecodingParams(...): the constraint holds on a random model's samples."""
    import re

    from pagedserve import GuidedDecodingParams, SamplingParams, StructuredOutputsParams
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    params = [SamplingParams(temperature=1.0, seed=1, max_tokens=12, n=3,
                             structured_outputs=StructuredOutputsParams(regex=r"(yes|no)-[0-9]")),
              SamplingParams(temperature=1.0, seed=2, max_tokens=8,
                             guided_decoding=GuidedDecodingParams(choice=["left", "right"])),
              SamplingParams(temperature=1.0, seed=3, max_tokens=30, structured_outputs=StructuredOutputsParams(
                  json=schema, disable_additional_properties=True, disable_any_whitespace=True))]
    outs = llm.generate(PROMPTS, params)
    assert all(re.fullmatch(r"(yes|no)-[0-9]", o.text) for o in outs[0].outputs), outs[0].outputs
    assert outs[1].outputs[0].text in ("left", "right")
    assert json.loads(outs[2].outputs[0].text) in ({"ok": True}, {"ok": False})
    for bad, words in ((dict(regex="a", choice=["b"]), "exactly one of"), (dict(whitespace_pattern=" "), "whitespace"),
                       (dict(json="{oops"), "structured_outputs.json is not valid JSON")):
        with pytest.raises(ValueError, match=words):
            SamplingParams(structured_outputs=StructuredOutputsParams(**bad))
    with pytest.raises(ValueError, match="regex is invalid"):  # compiled when the request is added
        llm.generate(PROMPTS[0], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(a")))


def test_truncate_prompt_tokens_reads_the_prompts_end(llm, model):
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPTS[2])
    out = llm.generate(PROMPTS[2], greedy(6, truncate_prompt_tokens=5))[0]
    assert out.prompt_token_ids == ids[-5:] and out.outputs[0].token_ids == hf_greedy(model, [ids[-5:]], 6)[0]
    assert llm.generate(PROMPTS[0], greedy(2, truncate_prompt_tokens=-1))[0].prompt_token_ids == tok.encode(PROMPTS[0])
    for bad in (0, -2):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            greedy(2, truncate_prompt_tokens=bad)
    with pytest.raises(ValueError, match="greater than the model's maximum context"):
        llm.generate(PROMPTS[0], greedy(2, truncate_prompt_tokens=10**6))


def test_seeded_sampling_with_n_is_reproducible(llm):
    from pagedserve import SamplingParams
    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True, logprobs=0)
    first, second = (llm.generate(PROMPTS[:2], params) for _ in range(2))
    assert [[s.token_ids for s in o.outputs] for o in first] == [[s.token_ids for s in o.outputs] for o in second]
    for o in first:
        assert [s.index for s in o.outputs] == [0, 1, 2]
        assert len({tuple(s.token_ids) for s in o.outputs}) > 1  # n samples, not one copied
        assert all(len(s.logprobs) == 10 and s.cumulative_logprob < 0 for s in o.outputs)
    other = llm.generate(PROMPTS[:2], SamplingParams(n=3, temperature=1.0, seed=99, max_tokens=10, ignore_eos=True))
    assert [s.token_ids for s in other[0].outputs] != [s.token_ids for s in first[0].outputs]


def test_chat_goes_through_the_template(llm):
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    (out,) = llm.chat(messages, greedy(5))
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert out.prompt_token_ids == list(expected)
    assert out.prompt.endswith("<|im_start|>assistant\n")
    # continue_final_message: the assistant's turn is left open, no new one started.
    partial = messages + [{"role": "assistant", "content": "The capital is"}]
    (cont,) = llm.chat(partial, greedy(3), add_generation_prompt=False, continue_final_message=True)
    assert cont.prompt.endswith("The capital is")
    with pytest.raises(ValueError, match="continue_final_message needs the last message"):
        llm.chat(messages, greedy(3), add_generation_prompt=False, continue_final_message=True)
    # A list of chats: one output each, as a batch.
    both = llm.chat([messages, partial], greedy(3), add_generation_prompt=False, continue_final_message=False)
    assert len(both) == 2


def test_bad_input_fails_before_anything_runs(llm, model):
    from pagedserve import LLM
    with pytest.raises(TypeError, match="unknown engine argument 'max_num_seq'"):
        LLM(model=str(model), max_num_seq=4)
    with pytest.raises(ValueError, match=r"prompts\[1\].*vocabulary"):
        llm.generate(["fine", {"prompt_token_ids": [1, 10**9]}], greedy(2))
    with pytest.raises(ValueError, match=r"prompts\[1\]: the prompt has 2000 tokens.*max_model_len"):
        llm.generate(["fine", {"prompt_token_ids": [5] * 2000}], greedy(2))
    with pytest.raises(ValueError, match="top_p"):
        from pagedserve import SamplingParams
        SamplingParams(top_p=3.0)
    assert not llm.engine.has_unfinished()
    assert llm.generate("fine", greedy(2))[0].finished


def test_async_llm_streams_growing_outputs_to_the_same_text(llm, model):
    from pagedserve import AsyncLLM
    reference = {p: llm.generate(p, greedy(10))[0].outputs[0] for p in PROMPTS[:2]}

    async def collect(engine, prompt, rid):
        return [out async for out in engine.generate(prompt, greedy(10), request_id=rid)]

    async def main():
        async with AsyncLLM(model=str(model), **ENGINE_ARGS) as engine:
            streams = await asyncio.gather(*(collect(engine, p, f"r{i}") for i, p in enumerate(PROMPTS[:2])))
            # Leaving early aborts: the engine is idle again, and the id can be used again.
            async for _ in engine.generate(PROMPTS[0], greedy(50), request_id="r0"):
                break
            for _ in range(200):  # the abort reaches the engine thread at its next step
                if not engine.engine.has_unfinished():
                    break
                await asyncio.sleep(0.05)
            assert not engine.engine.has_unfinished()
            again = await collect(engine, PROMPTS[0], "r0")
            assert again[-1].outputs[0].text == reference[PROMPTS[0]].text
            return streams

    streams = asyncio.run(main())
    for prompt, outs in zip(PROMPTS[:2], streams):
        assert len(outs) > 1
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        assert lengths == sorted(lengths) and lengths[-1] == 10
        texts = [o.outputs[0].text for o in outs]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert (texts[-1], outs[-1].outputs[0].token_ids) == (reference[prompt].text, reference[prompt].token_ids)


def test_tokenizer_and_chat_template_arguments(default_model_path, tmp_path):
    from pagedserve import LLM
    from tiny_models import build_tiny_model
    folder = build_tiny_model(tmp_path / "bare", vocab_size=49152, max_position_embeddings=256, eos_token_id=2)
    with pytest.raises(FileNotFoundError, match=f"no tokenizer in {folder}.*--tokenizer"):
        LLM(model=str(folder), **ENGINE_ARGS)
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if greet %}hi{% endif %}"
    with LLM(model=str(folder), tokenizer=str(default_model_path), chat_template=template, **ENGINE_ARGS) as llm:
        (out,) = llm.chat([{"role": "user", "content": "x"}], greedy(2), chat_template_kwargs={"greet": True})
        assert out.prompt == "<user>xhi"
        assert out.prompt_token_ids == llm.get_tokenizer().encode("<user>xhi", add_special_tokens=False)
        assert len(out.outputs[0].token_ids) == 2


def test_prompt_logprobs_as_vllm_returns_them(llm, model):
    import torch
    import transformers

    out, only = llm.generate([PROMPTS[1], PROMPTS[2]], [greedy(2, prompt_logprobs=1), greedy(0, prompt_logprobs=0)])
    reference = transformers.AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
    for o, k in ((out, 1), (only, 0)):
        ids = o.prompt_token_ids
        with torch.no_grad():
            dist = reference(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
        want = dist.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).tolist()
        assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(ids)
        assert [e.token_id for e in o.prompt_logprobs[1:]] == ids[1:]
        assert max(abs(e.logprob - w) for e, w in zip(o.prompt_logprobs[1:], want)) < 1e-3
        assert all(len(e.top_logprobs) == k for e in o.prompt_logprobs[1:])
    assert len(out.outputs[0].token_ids) == 2
    assert only.outputs[0].token_ids == [] and only.outputs[0].finish_reason == "length" and only.finished


def test_a_one_token_request_leaves_its_prompt_in_the_prefix_cache(llm):
    """A request that ends in its prefill step (max_tokens 1, lm-eval's loglikelihood requests)
    still leaves its full blocks in the prefix cache: the same 79-token prompt again hits 64."""
    prompt = {"prompt_token_ids": list(range(300, 379))}
    first = llm.generate([prompt], greedy(1))[0]
    again = llm.generate([prompt], greedy(1))[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 64
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_no_sampling_params_take_the_models_generation_config(llm, model, tmp_path):
    """vLLM's LLM.get_default_sampling_params: the model's generation_config.json sampling entries (here a
    folder of its own with temperature 0 and max_new_tokens 3) are generate's and chat's params when none
    are given; "vllm" (this module's engine: none in the model's config) leaves SamplingParams()."""
    from pagedserve import LLM, SamplingParams
    assert llm.get_default_sampling_params() == SamplingParams()
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 3}))
    with LLM(model=str(model), generation_config=str(folder), **ENGINE_ARGS) as own:
        assert own.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=3)
        (out,) = own.generate(PROMPTS[1])
        assert out.outputs[0].token_ids == llm.generate(PROMPTS[1], greedy(3))[0].outputs[0].token_ids[:3]
        (chat,) = own.chat([{"role": "user", "content": "Hi"}])
        assert len(chat.outputs[0].token_ids) <= 3
    with pytest.raises(ValueError, match="generation config"):
        LLM(model=str(model), override_generation_config={"top_p": 2.0}, **ENGINE_ARGS)


def test_seed_makes_unseeded_sampling_repeat(model):
    """vLLM's --seed: requests without a seed of their own draw the same tokens in two engines started with
    the same seed (the same steps); unseeded engines would draw others (12 tokens at temperature 1)."""
    from pagedserve import LLM, SamplingParams
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)

    def sampled(seed):
        with LLM(model=str(model), seed=seed, **ENGINE_ARGS) as engine:
            return [o.outputs[0].token_ids for o in engine.generate(PROMPTS, params)]
    assert sampled(7) == sampled(7)
