"""A raw text prompt becomes token ids in one place (model_files/chat_templates.text_token_ids):
with the tokenizer's special tokens, as vLLM and transformers do, on every path — the cli's
prompt lines, the offline engine's prompts and the tokenizer service. A Gemma-like tokenizer
that adds <bos> shows it (without it Gemma 3 answers nonsense)."""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from pagedserve.cli import parse_prompt_line
from pagedserve.engine.llm import encode_prompt
from pagedserve.model_files.chat_templates import text_token_ids

VOCAB = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3, "hello": 4, "world": 5}


@pytest.fixture(scope="module")
def bos_tokenizer() -> PreTrainedTokenizerFast:
    raw = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")


def test_text_prompts_start_with_bos(bos_tokenizer):
    assert text_token_ids(bos_tokenizer, "hello world") == [1, 4, 5]


def test_cli_prompt_lines_add_the_special_tokens_as_the_engine_does(bos_tokenizer):
    ids, params = parse_prompt_line('{"prompt": "hello world", "max_tokens": 3}', "--prompt", bos_tokenizer)
    assert ids == [1, 4, 5] and params.max_tokens == 3
    assert encode_prompt(bos_tokenizer, "hello world", "prompts[0]") == ("hello world", ids)
    ids, _ = parse_prompt_line('{"prompt_token_ids": [4, 5]}', "--prompt", bos_tokenizer)
    assert ids == [4, 5]  # ids are the caller's as given
