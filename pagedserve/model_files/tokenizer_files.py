"""A model folder's tokenizer, loaded without torch.

transformers' AutoTokenizer imports torch (through its model configuration classes) before it
reads a file, which would put libtorch (~300 MB) into the tokenizer service. A folder with a
`tokenizer.json` is loaded by the class AutoTokenizer itself builds on, the `tokenizers`-backed
tokenizer, which needs no torch and encodes, decodes and renders chat templates identically
(tests/test_tokenizer_files.py compares them). Only a folder without `tokenizer.json` (a
sentencepiece-only checkpoint) goes through AutoTokenizer.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)


def load_tokenizer(folder: str | Path):
    """The folder's HF tokenizer (encode, decode, apply_chat_template, len)."""
    folder = Path(folder)
    if (folder / "tokenizer.json").is_file():
        try:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend as FastTokenizer
        except ImportError:  # transformers 4.x
            from transformers.tokenization_utils_fast import PreTrainedTokenizerFast as FastTokenizer
        return FastTokenizer.from_pretrained(folder)
    log.warning("%s has no tokenizer.json: loading it through AutoTokenizer, which imports torch", folder)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(folder)
