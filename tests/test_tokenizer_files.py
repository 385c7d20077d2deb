"""The tokenizer service's torch-free tokenizer (model_files.tokenizer_files) against transformers'
AutoTokenizer on the same folder: equal ids, text and chat-template output, and no torch loaded."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedserve.model_files.tokenizer_files import load_tokenizer

pytestmark = pytest.mark.slow  # the default model's tokenizer

TEXTS = ["Hello world", "  leading spaces and\ttabs\n\nnewlines", "naïve café — 東京 🚀 emoji",
         "<|im_start|>user\nspecial tokens as text<|im_end|>", "def f(x):\n    return x ** 2\n", ""]
CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3 — 東京?"}],
]


@pytest.fixture(scope="module")
def both(default_model_path):
    from transformers import AutoTokenizer
    return load_tokenizer(default_model_path), AutoTokenizer.from_pretrained(default_model_path)


def ids_of(out):
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_encode_and_decode_equal_autotokenizer(both):
    ours, ref = both
    assert len(ours) == len(ref)
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert ours.eos_token_id == ref.eos_token_id


def test_chat_template_equals_autotokenizer(both):
    ours, ref = both
    for messages in CHATS:
        for generation_prompt in (True, False):
            kwargs = dict(add_generation_prompt=generation_prompt)
            assert ids_of(ours.apply_chat_template(messages, tokenize=True, **kwargs)) == \
                ids_of(ref.apply_chat_template(messages, tokenize=True, **kwargs))
            assert ours.apply_chat_template(messages, tokenize=False, **kwargs) == \
                ref.apply_chat_template(messages, tokenize=False, **kwargs)


def test_loading_and_using_it_imports_no_torch(default_model_path):
    code = ("import sys; from pagedserve.model_files.tokenizer_files import load_tokenizer; "
            f"t = load_tokenizer({str(default_model_path)!r}); "
            "t.apply_chat_template([{'role': 'user', 'content': 'hi'}], add_generation_prompt=True, tokenize=True); "
            "t.decode(t.encode('hello')); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
