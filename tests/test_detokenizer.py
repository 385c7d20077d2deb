"""Incremental detokenization and stop strings: property tests on the default model's real
tokenizer (the `tokenizer` fixture of conftest.py)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.tokenizer.detokenizer import IncrementalDetokenizer, StopStringMatcher

# -- StopStringMatcher (no model needed) ---------------------------------------------------------


def run_matcher(deltas, stop, include=False):
    m = StopStringMatcher(stop, include)
    out, fed = [], ""
    for d in deltas:
        fed += d
        text, stopped = m.feed(d)
        out.append(text)
        if stopped:
            return "".join(out), True, fed
    out.append(m.flush())
    return "".join(out), False, fed


def expected_cut(fed, stop, include):
    hits = [(fed.find(s), len(s)) for s in stop if s and s in fed]
    if not hits:
        return fed
    at, n = min(hits)
    return fed[:at + n] if include else fed[:at]


@given(st.lists(st.text("abc.\n", max_size=6), max_size=12),
       st.lists(st.text("abc.\n", min_size=1, max_size=4), min_size=1, max_size=3), st.booleans())
@settings(max_examples=400, deadline=None)
def test_stop_strings_property(deltas, stop, include):
    text, stopped, fed = run_matcher(deltas, stop, include)
    # It stops at the first delta after which the text holds a stop string, not later.
    first_hit = next((i for i in range(len(deltas)) if any(s in "".join(deltas[:i + 1]) for s in stop)), None)
    assert stopped == (first_hit is not None)
    if stopped:
        assert fed == "".join(deltas[:first_hit + 1])
    assert text == expected_cut(fed, stop, include)
    if not include:
        assert not any(s in text for s in stop)


def test_stop_string_split_across_deltas():
    assert run_matcher(["Hello wo", "r", "ld! More"], ["world"]) == ("Hello ", True, "Hello world! More")
    assert run_matcher(["Hello wo", "r", "ld! More"], ["world"], True)[0] == "Hello world"
    # Text that only looked like a stop string's start is released once it cannot be one.
    m = StopStringMatcher(["STOP"])
    assert m.feed("go ST") == ("go ", False)
    assert m.feed("OP") == ("", True)
    m = StopStringMatcher(["STOP"])
    assert m.feed("ST") == ("", False)
    assert m.feed("ART") == ("START", False)
    assert m.feed("S") == ("", False)
    assert m.flush() == "S"
    assert StopStringMatcher([]).feed("anything") == ("anything", False)


def test_stop_string_earliest_wins():
    assert run_matcher(["xx abcd"], ["bcd", "ab"])[0] == "xx "
    assert run_matcher(["xx abcd"], ["abc", "ab"], True)[0] == "xx ab"
    m = StopStringMatcher(["."])
    assert m.feed("a.b") == ("a", True)
    assert m.feed("more") == ("", True)
    assert m.flush() == ""


# -- IncrementalDetokenizer on the default model's tokenizer --------------------------------------




def detokenize_all(tok, prompt_ids, out_ids, chunks, skip):
    d = IncrementalDetokenizer(tok, prompt_ids, skip)
    deltas, pos = [], 0
    for size in chunks:
        deltas.append(d.step(out_ids[pos:pos + size]))
        pos += size
    deltas.append(d.step(out_ids[pos:]))
    deltas.append(d.flush())
    return deltas


def check_stream(tok, prompt_ids, out_ids, chunks, skip):
    deltas = detokenize_all(tok, prompt_ids, out_ids, chunks, skip)
    full = tok.decode(out_ids, skip_special_tokens=skip)
    assert "".join(deltas) == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas)


ids_strategy = st.lists(st.integers(0, 49151), max_size=40)
# Low ids are special tokens; 28-300 are mostly single bytes, so partial UTF-8 sequences are common.
byte_heavy = st.lists(st.one_of(st.integers(0, 20), st.integers(28, 300), st.integers(0, 49151)), max_size=40)
chunks_strategy = st.lists(st.integers(1, 4), max_size=20)


@pytest.mark.slow
@given(prompt=ids_strategy, out=st.one_of(ids_strategy, byte_heavy), chunks=chunks_strategy, skip=st.booleans())
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_random_token_ids_property(tokenizer, prompt, out, chunks, skip):
    check_stream(tokenizer, prompt, out, chunks, skip)


unicode_text = st.lists(st.sampled_from(list("abc xyz,.\n") + list("éüñçåøßàï") + list("世界你好日本語中文")
                                       + ["🎉", "😀", "👍🏽", "🇫🇷", "∑", "€"]), max_size=30).map("".join)


@pytest.mark.slow
@given(prompt=unicode_text, text=unicode_text, chunks=chunks_strategy, skip=st.booleans())
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_unicode_text_property(tokenizer, prompt, text, chunks, skip):
    prompt_ids = tokenizer.encode(prompt)
    full_ids = tokenizer.encode(prompt + text)
    # Continue from where the prompt's own encoding and the joint one agree.
    out = full_ids[len(prompt_ids):] if full_ids[:len(prompt_ids)] == prompt_ids else tokenizer.encode(text)
    check_stream(tokenizer, prompt_ids, out, chunks, skip)
    deltas = detokenize_all(tokenizer, prompt_ids, out, [1] * len(out), skip)
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.slow
def test_first_token_keeps_its_leading_space(tokenizer):
    prompt = tokenizer.encode("The capital of France is")
    out = tokenizer.encode(" Paris, of course")
    d = IncrementalDetokenizer(tokenizer, prompt, True)
    deltas = [d.step([t]) for t in out] + [d.flush()]
    assert deltas[0] == " Paris"
    assert "".join(deltas) == " Paris, of course"
    # Chat prompts end in special tokens; skipping them must not eat the answer's first characters.
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False)
    d = IncrementalDetokenizer(tokenizer, tokenizer.encode(chat), True)
    assert "".join([d.step([t]) for t in tokenizer.encode("Hello!")] + [d.flush()]) == "Hello!"


@pytest.mark.slow
def test_multibyte_character_is_never_split(tokenizer):
    out = tokenizer.encode(" 🎉世界")
    d = IncrementalDetokenizer(tokenizer, tokenizer.encode("Party"), True)
    deltas = [d.step([t]) for t in out]
    # Byte-level BPE spells these characters over several tokens; nothing shows until one is whole.
    assert [x for x in deltas if x] == [" 🎉", "世", "界"] and len(out) > 3
    # A window never grows with the output: old ids are dropped.
    long = tokenizer.encode(" word" * 500)
    d = IncrementalDetokenizer(tokenizer, [], True)
    for t in long:
        d.step([t])
    assert len(d.ids) <= 4


@pytest.mark.slow
def test_sample_text_uses_ids_up_to_the_stop(tokenizer):
    from pagedserve.tokenizer.detokenizer import SampleText
    out = tokenizer.encode(" one two. three")
    st_ = SampleText(tokenizer, tokenizer.encode("Count:"), True, ["."], False)
    text, used, stopped = st_.push(out)
    assert (text, stopped) == (" one two", True)
    assert tokenizer.decode(out[:used]).endswith(".") and not tokenizer.decode(out[:used - 1]).endswith(".")
    # A stop string completed only by the held-back tail is still caught at the end.
    st_ = SampleText(tokenizer, [], True, ["🎉"], True)
    emoji = tokenizer.encode(" 🎉")
    assert st_.push(emoji[:-1]) == ("", len(emoji) - 1, False)
    assert st_.push(emoji[-1:], final=True) == (" 🎉", 1, True)


def test_the_default_tokenizer_decodes_in_rust(tokenizer):
    """The property tests above compare against the wrapper's decode; this one makes sure they test
    the Rust path the tokenizer service takes, not the fallback."""
    from pagedserve.tokenizer.detokenizer import rust_decoder
    assert rust_decoder(tokenizer) is not None
    assert IncrementalDetokenizer(tokenizer, [], True)._backend is rust_decoder(tokenizer)
