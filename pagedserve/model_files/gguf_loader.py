"""GGUF (llama.cpp) checkpoints as HF-layout config and tokenizer (no torch: the tokenizer service uses
this); pagedserve.worker.gguf_weights reads the weights.

The metadata parser is our own rather than gguf.GGUFReader: the reader builds a numpy
view per array element, which costs seconds on a 49k-token vocabulary. Dequantization
is left to gguf.quants so results are bit-identical to transformers' GGUF loader.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import re
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from pagedserve.model_files.gguf_arch_configs import CONFIG_HOOKS, DEFAULT_LAYER_NAMES, GLOBAL_NAMES, LAYER_NAMES

log = logging.getLogger(__name__)

# GGUF architecture -> (HF architecture, HF model_type, Q/K rows stored in llama.cpp rotary order)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "gemma2": ("Gemma2ForCausalLM", "gemma2", False),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text", False),
    "olmo2": ("Olmo2ForCausalLM", "olmo2", False),
    "command-r": ("CohereForCausalLM", "cohere", False),  # llama.cpp's rotary on interleaved pairs, as HF's
    "cohere2": ("Cohere2ForCausalLM", "cohere2", False),
    "starcoder2": ("Starcoder2ForCausalLM", "starcoder2", False),
}
# Chat templates shipped for GGUF architectures whose files usually carry none (templates/*.jinja).
BUILTIN_CHAT_TEMPLATES = {"gemma2": "gemma3.jinja", "gemma3": "gemma3.jinja"}  # Gemma 2's turns are Gemma 3's
PREPARED_FILES = ("config.json", "tokenizer_config.json", "model.gguf")

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
           10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY, _FLOAT32 = 8, 9, 6
_CHUNK_BLOCKS = 1 << 14

_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


@dataclass(slots=True)
class _TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: innermost (row length) first
    qtype: GGMLQuantizationType
    offset: int  # absolute, in the file


class GGUFFile:
    """Metadata and tensor directory of a GGUF file; tensor bytes stay memory-mapped."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._pos = 0
            self._parse()
        except ValueError as exc:
            raise ValueError(f"{self.path}: not a valid GGUF file ({exc})") from exc
        except (struct.error, UnicodeDecodeError, OverflowError, IndexError) as exc:
            raise ValueError(f"{self.path}: corrupt or truncated GGUF file ({exc})") from exc

    def _unpack(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._unpack("<Q")
        if self._pos + n > len(self._buf):
            raise struct.error("string runs past end of file")
        s = self._buf[self._pos:self._pos + n].decode("utf-8")
        self._pos += n
        return s

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            item_type, count = self._unpack("<I"), self._unpack("<Q")
            if item_type in _SCALAR and item_type != 7:  # numeric arrays in one go
                arr = np.frombuffer(self._buf, _SCALAR[item_type], count, self._pos)
                self._pos += arr.nbytes
                return arr.tolist()
            return [self._value(item_type) for _ in range(count)]
        if vtype not in _SCALAR:
            raise ValueError(f"unknown metadata value type {vtype}")
        value = self._unpack(_SCALAR[vtype])
        # float32 metadata (eps, rope base) reads back as e.g. 9.99999974e-06; keep the intended 1e-05
        return float(str(np.float32(value))) if vtype == _FLOAT32 else value

    def _parse(self) -> None:
        if self._buf[:4] != b"GGUF":
            raise ValueError("bad magic")
        version = self._unpack("<4xI")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        n_tensors, n_kv = self._unpack("<Q"), self._unpack("<Q")
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = tuple(self._unpack("<Q") for _ in range(self._unpack("<I")))
            infos.append((name, dims, GGMLQuantizationType(self._unpack("<I")), self._unpack("<Q")))
        align = int(self.fields.get("general.alignment", 32))
        data_start = -(-self._pos // align) * align
        self.tensors: dict[str, _TensorInfo] = {}
        for name, dims, qtype, offset in infos:
            info = _TensorInfo(name, dims, qtype, data_start + offset)
            if dims and dims[0] % GGML_QUANT_SIZES[qtype][0]:
                raise ValueError(f"tensor {name} row length {dims[0]} is not a multiple of its block size")
            if info.offset + self._nbytes(info) > len(self._buf):
                raise struct.error(f"tensor {name} runs past end of file")
            self.tensors[name] = info

    @staticmethod
    def _nbytes(info: _TensorInfo) -> int:
        block, type_size = GGML_QUANT_SIZES[info.qtype]
        return int(np.prod(info.dims)) // block * type_size

    def blocks(self, name: str) -> np.ndarray:
        """A 2-D tensor's bytes as uint8 [rows, bytes per row] (a view of the memory map)."""
        info = self.tensors[name]
        rows = int(np.prod(info.dims[1:]))
        return np.frombuffer(self._buf, np.uint8, self._nbytes(info), info.offset).reshape(rows, -1)

    def dequantized(self, name: str) -> np.ndarray:
        """float32 array in numpy order ([rows, row_length])."""
        info = self.tensors[name]
        block, type_size = GGML_QUANT_SIZES[info.qtype]
        blocks = np.frombuffer(self._buf, np.uint8, self._nbytes(info), info.offset).reshape(-1, type_size)
        shape = tuple(reversed(info.dims))
        # gguf.quants works through a tensor 16 rows at a time, mostly Python overhead on narrow
        # rows; handing it fixed-size runs of blocks as single rows is ~2x faster, same values.
        try:
            out = np.concatenate([dequantize(blocks[i:i + _CHUNK_BLOCKS].reshape(1, -1), info.qtype).ravel()
                                  for i in range(0, len(blocks), _CHUNK_BLOCKS)])
        except NotImplementedError as exc:
            raise ValueError(f"{self.path}: tensor {name} has unsupported type {info.qtype.name}") from exc
        return out.reshape(shape)


def gguf_arch(g: GGUFFile) -> str:
    arch = g.fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{g.path}: unsupported GGUF architecture {arch!r}; "
                         f"supported: {', '.join(ARCHITECTURES)}")
    return arch


def hf_config(g: GGUFFile) -> dict:
    arch = gguf_arch(g)
    hf_arch, model_type, _ = ARCHITECTURES[arch]
    f = g.fields

    def key(name, default=None):
        return f.get(f"{arch}.{name}", default)

    required = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
    if missing := [f"{arch}.{name}" for name in required if key(name) is None]:
        raise ValueError(f"{g.path}: GGUF metadata lacks {', '.join(missing)}")
    if "token_embd.weight" not in g.tensors:
        raise ValueError(f"{g.path}: GGUF has no token_embd.weight tensor")
    heads, hidden = key("attention.head_count"), key("embedding_length")
    vocab = key("vocab_size") or g.tensors["token_embd.weight"].dims[1]
    head_dim = key("attention.key_length") or key("rope.dimension_count") or hidden // heads
    rope_theta = key("rope.freq_base", 10000.0)
    cfg = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": rope_theta,  # transformers 4 layout; 5 reads rope_parameters
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "max_position_embeddings": key("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "attention_bias": "blk.0.attn_q.bias" in g.tensors,
        "bos_token_id": f.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": f.get("tokenizer.ggml.eos_token_id"),
    }
    if "tokenizer.ggml.padding_token_id" in f:
        cfg["pad_token_id"] = f["tokenizer.ggml.padding_token_id"]
    scaling = key("rope.scaling.type")
    if scaling and scaling != "none":
        cfg["rope_scaling"] = {"rope_type": scaling, "factor": key("rope.scaling.factor", 1.0)}
        if original := key("rope.scaling.original_context_length"):
            cfg["rope_scaling"]["original_max_position_embeddings"] = original
        cfg["rope_parameters"].update(cfg["rope_scaling"])
    if hook := CONFIG_HOOKS.get(arch):
        hook(g, cfg, key)
    if "rope_freqs.weight" in g.tensors:
        # Llama 3.x GGUFs bake the llama3 rope scaling into a tensor; transformers ignores it too,
        # which only matters beyond the original context length.
        log.warning("%s: ignoring rope_freqs.weight (llama3 rope scaling is not reconstructed)", g.path)
    return cfg


def gguf_to_hf_config(gguf_path: str | Path) -> dict:
    """The HF config.json dict describing the model in a GGUF file."""
    return hf_config(GGUFFile(gguf_path))


def hf_name(name: str, arch: str = "llama") -> str | None:
    if m := _BLOCK.fullmatch(name):
        suffix = LAYER_NAMES.get(arch, DEFAULT_LAYER_NAMES).get(m[2])
        return f"model.layers.{m[1]}.{suffix}" if suffix else None
    return GLOBAL_NAMES.get(name)


def _gguf_tokenizer(folder: Path):
    """transformers' tokenizer for folder/model.gguf. Where its GGUF loader does not know the architecture
    (olmo2, command-r, cohere2: AutoTokenizer reads the model's config first and refuses them), the
    same tokenizer built from the file's metadata by its generic fast-tokenizer class."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(folder, gguf_file="model.gguf")
    except ValueError as exc:
        if "is not supported" not in str(exc):
            raise
        return PreTrainedTokenizerFast.from_pretrained(folder, gguf_file="model.gguf")


def is_prepared_folder(folder: str | Path) -> bool:
    return all((Path(folder) / name).is_file() for name in PREPARED_FILES)


def prepare_gguf_folder(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """A model folder (config, tokenizer, generation config, model.gguf) built from a GGUF file, once."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if is_prepared_folder(out_dir):
        return out_dir
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists but is not a prepared GGUF folder; remove it to rebuild")
    g = GGUFFile(gguf_path)
    cfg = hf_config(g)  # validates the file before any heavier work
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: a concurrent or interrupted run never leaves a partial folder.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        try:
            os.link(gguf_path, tmp / "model.gguf")
        except OSError:  # other filesystem, or no hard links
            shutil.copyfile(gguf_path, tmp / "model.gguf")
        arch = gguf_arch(g)
        tokenizer = _gguf_tokenizer(tmp)
        if not getattr(tokenizer, "chat_template", None) and arch in BUILTIN_CHAT_TEMPLATES:
            template = Path(__file__).parent / "templates" / BUILTIN_CHAT_TEMPLATES[arch]
            tokenizer.chat_template = template.read_text(encoding="utf-8")
        tokenizer.save_pretrained(tmp)
        # Chat models end turns with an end-of-turn token that is not always the eos token.
        eot = g.fields.get("tokenizer.ggml.eot_token_id", cfg.pop("eot_token_id", None))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        eos = [cfg["eos_token_id"]]
        if eot not in (None, *eos):
            eos.append(eot)
        gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": eos[0] if len(eos) == 1 else eos}
        if "pad_token_id" in cfg:
            gen["pad_token_id"] = cfg["pad_token_id"]
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp's 0700 would keep a shared cache private
        try:
            if out_dir.exists():
                out_dir.rmdir()  # empty, checked above
            tmp.rename(out_dir)
        except OSError:
            if not is_prepared_folder(out_dir):  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
