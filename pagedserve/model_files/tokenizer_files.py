"""A model folder's tokenizer, loaded without torch.

transformers' AutoTokenizer imports torch (through its model configuration classes) before it
reads a file, which would put libtorch (~300 MB) into the tokenizer service. A folder with a
`tokenizer.json` is loaded by the class AutoTokenizer itself builds on, the `tokenizers`-backed
tokenizer, which needs no torch and encodes, decodes and renders chat templates identically
(tests/test_tokenizer_files.py compares them). Only a folder without `tokenizer.json` (a
sentencepiece-only checkpoint) goes through AutoTokenizer.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)


# A folder with none of these holds no tokenizer AutoTokenizer could build (it would fail with
# "You need to have sentencepiece or tiktoken installed", which names neither folder nor cure).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "spiece.model",
                   "tokenizer.tiktoken", "vocab.txt")


def load_tokenizer(folder: str | Path):
    """The folder's HF tokenizer (encode, decode, apply_chat_template, len). A folder without
    tokenizer files raises FileNotFoundError naming it and the --tokenizer flag."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"no tokenizer: {folder} is not a folder")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(f"no tokenizer in {folder}: it has none of {', '.join(TOKENIZER_FILES)}; "
                                "pass --tokenizer FOLDER (tokenizer=... in the Python API) with the model's "
                                "tokenizer files")
    if (folder / "tokenizer.json").is_file():
        try:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend as FastTokenizer
        except ImportError:  # transformers 4.x
            from transformers.tokenization_utils_fast import PreTrainedTokenizerFast as FastTokenizer
        return with_processor_template(FastTokenizer.from_pretrained(folder), folder)
    log.warning("%s has no tokenizer.json: loading it through AutoTokenizer, which imports torch", folder)
    from transformers import AutoTokenizer
    try:
        return with_processor_template(AutoTokenizer.from_pretrained(folder), folder)
    except (OSError, ValueError, ImportError) as exc:
        raise ValueError(f"cannot load the tokenizer of {folder}: {exc}") from None


def with_processor_template(tokenizer, folder: Path):
    """A vision-language folder may keep its chat template in the processor's chat_template.json only
    (the tokenizer reads tokenizer_config.json's and chat_template.jinja): take it from there, as vLLM
    does, when the tokenizer has none."""
    path = folder / "chat_template.json"
    if tokenizer.chat_template is None and path.is_file():
        try:
            template = json.loads(path.read_text()).get("chat_template")
        except (json.JSONDecodeError, AttributeError) as exc:
            raise ValueError(f"corrupt chat_template.json in {folder}: {exc}") from None
        tokenizer.chat_template = template if isinstance(template, (str, type(None))) else None
    return tokenizer
