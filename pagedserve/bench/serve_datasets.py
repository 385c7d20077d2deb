"""The requests of `pagedserve bench serve`: random prompts (token ids of a tokenizer's vocabulary,
or common words without one), shared prefixes with suffixes, and ShareGPT conversations; and the
tokenizer that measures them (--tokenizer, or the model's own folder)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# ShareGPT filtering, as vLLM's benchmark does it.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT = 1024
SHAREGPT_MAX_TOTAL = 2048
# Text prompts when no tokenizer is known: common English words, about one token each.
WORDS = ("the of and to in is was for on are with as at be by this have from or one had not but what all were "
         "when we there can an your which their said if will each about how up out them then she many some so "
         "these would other into has more her two like him see time could no make than first been its who now "
         "people my made over did down only way find use may water long little very after words called just "
         "where most know get through back much before go good new write our used me man too any day same right "
         "look think also around another came come work three word must because does part even place well such "
         "here take why things help put years different away again off went old number great tell men say small "
         "every found still between name should home big give air line set own under read last never us left end "
         "along while might next sound below saw something thought both few those always looked show large often "
         "together asked house world going want school important until form food keep children feet land side "
         "without boy once animals life enough took sometimes four head above kind began almost live page got "
         "earth need far hand high year mother light parts country father let night following picture being study "
         "second eyes soon times story boys since white days ever paper hard near sentence better best across "
         "during today others however sure means knew try told young miles sun ways thing whole hear example "
         "heard several change answer room sea against top turned learn point city play toward five using himself "
         "usually").split()


@dataclass(slots=True)
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int  # as generated or estimated; the server's usage replaces it when given
    output_len: int


class PromptMaker:
    """Random prompts of a given length: token ids of the tokenizer's vocabulary when there is one
    (special tokens left out), else random common words."""

    def __init__(self, tokenizer=None) -> None:
        self.tokenizer = tokenizer
        self.ids: np.ndarray | None = None
        if tokenizer is not None:
            vocab = int(getattr(tokenizer, "vocab_size", 0) or len(tokenizer))
            special = set(getattr(tokenizer, "all_special_ids", []) or [])
            self.ids = np.asarray([i for i in range(min(100, vocab // 2), vocab) if i not in special])

    @property
    def kind(self) -> str:
        return "token_ids" if self.ids is not None else "text"

    def make(self, rng: np.random.Generator, length: int) -> str | list[int]:
        if self.ids is not None:
            return self.ids[rng.integers(0, len(self.ids), length)].tolist()
        return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), length))

    @staticmethod
    def join(prefix: str | list[int], suffix: str | list[int]) -> str | list[int]:
        return prefix + suffix if isinstance(prefix, list) else f"{prefix} {suffix}"


def _lengths(rng: np.random.Generator, num: int, length: int, ratio: float) -> list[int]:
    low, high = max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))
    return rng.integers(low, high + 1, num).tolist()


def random_requests(num: int, input_len: int, output_len: int, range_ratio: float, seed: int,
                    maker: PromptMaker) -> list[BenchRequest]:
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    in_lens = _lengths(rng, num, input_len, range_ratio)
    out_lens = _lengths(rng, num, output_len, range_ratio)
    return [BenchRequest(maker.make(rng, n), n, o) for n, o in zip(in_lens, out_lens)]


def prefix_requests(num_prefixes: int, suffixes_per_prefix: int, prefix_len: int, suffix_len: int,
                    output_len: int, seed: int, maker: PromptMaker) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num_prefixes):
        prefix = maker.make(rng, prefix_len)
        for _ in range(suffixes_per_prefix):
            out.append(BenchRequest(maker.join(prefix, maker.make(rng, suffix_len)), prefix_len + suffix_len,
                                    output_len))
    random.Random(seed).shuffle(out)
    return out


def _count_tokens(text: str, tokenizer) -> int:
    if tokenizer is not None:
        return len(tokenizer(text, add_special_tokens=False).input_ids)
    return round(len(text.split()) * 1.3)


def load_sharegpt(path: str | Path, num: int, seed: int, tokenizer=None) -> list[BenchRequest]:
    """The first human turn of each conversation with the reply after it; shuffled (seeded), too
    short (< 4 tokens) or too long (prompt > 1024, prompt + reply > 2048) ones skipped."""
    text = Path(path).read_text()
    stripped = text.lstrip()
    if stripped.startswith("["):
        entries = json.loads(text)
    else:
        entries = [json.loads(line) for line in text.splitlines() if line.strip()]
    random.Random(seed).shuffle(entries)
    out = []
    for entry in entries:
        turns = entry.get("conversations") or entry.get("conversation") or []
        human = next((i for i, t in enumerate(turns) if t.get("from") in ("human", "user")), None)
        if human is None:
            continue
        reply = next((t for t in turns[human + 1:] if t.get("from") in ("gpt", "assistant", "chatgpt")), None)
        if reply is None:
            continue
        prompt = turns[human].get("value") or ""
        prompt_len, output_len = _count_tokens(prompt, tokenizer), _count_tokens(reply.get("value") or "", tokenizer)
        if prompt_len < SHAREGPT_MIN_LEN or output_len < SHAREGPT_MIN_LEN:
            continue
        if prompt_len > SHAREGPT_MAX_PROMPT or prompt_len + output_len > SHAREGPT_MAX_TOTAL:
            continue
        out.append(BenchRequest(prompt, prompt_len, output_len))
        if len(out) == num:
            break
    return out


def grounded_requests(num: int, output_len: int, tokenizer=None) -> list[BenchRequest]:
    """bench/grounded.py's prompts (repeat code with one change): chat-rendered token ids with a
    tokenizer, else the bare message text."""
    from pagedserve.bench.grounded import grounded_message, grounded_token_ids
    out = []
    for i in range(num):
        prompt = grounded_token_ids(tokenizer, i) if tokenizer is not None else grounded_message(i)
        out.append(BenchRequest(prompt, len(prompt) if tokenizer is not None else len(prompt.split()), output_len))
    return out


def build_dataset(args, tokenizer) -> tuple[list[BenchRequest], str]:
    maker = PromptMaker(tokenizer)
    if args.dataset == "random":
        return random_requests(args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed,
                               maker), maker.kind
    if args.dataset == "prefix":
        return prefix_requests(args.num_prefixes, args.suffixes_per_prefix, args.prefix_len, args.suffix_len,
                               args.output_len, args.seed, maker), maker.kind
    if args.dataset == "grounded":
        return grounded_requests(args.num_prompts, args.output_len, tokenizer), "ids" if tokenizer else "text"
    if not args.dataset_path:
        raise SystemExit("--dataset sharegpt needs --dataset-path FILE")
    requests = load_sharegpt(args.dataset_path, args.num_prompts, args.seed, tokenizer)
    if not requests:
        raise SystemExit(f"no usable conversation in {args.dataset_path}")
    return requests, "text"


def _local_model_folder(model: str | None) -> str | None:
    """The model id as a local folder, or as a model pagedserve has prepared (its id is the folder's name)."""
    if not model:
        return None
    if Path(model).is_dir():
        return model
    from pagedserve.model_files.default_model import data_dir

    prepared = data_dir() / "models" / Path(model).name
    return str(prepared) if (prepared / "tokenizer.json").is_file() else None


def load_tokenizer(name: str | None, model: str | None):
    """--tokenizer, else the model id when it names a local folder (or one pagedserve prepared); None
    when neither loads."""
    candidate = name or _local_model_folder(model)
    if candidate is None:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(candidate)
    except Exception as e:  # noqa: BLE001 - text prompts work without one
        if name:
            raise SystemExit(f"cannot load the tokenizer {name!r}: {e}") from None
        return None
