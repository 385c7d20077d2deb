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

log = logging.getLogger(__name__)

# GGUF architecture -> (HF architecture, HF model_type, Q/K rows stored in llama.cpp rotary order)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "gemma2": ("Gemma2ForCausalLM", "gemma2", False),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text", False),
}
# Chat templates shipped for GGUF architectures whose files usually carry none (templates/*.jinja).
BUILTIN_CHAT_TEMPLATES = {"gemma2": "gemma3.jinja", "gemma3": "gemma3.jinja"}  # Gemma 2's turns are Gemma 3's
PREPARED_FILES = ("config.json", "tokenizer_config.json", "model.gguf")

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
           10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY, _FLOAT32 = 8, 9, 6
_CHUNK_BLOCKS = 1 << 14

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 3 norms by llama.cpp's names: ffn_norm is the pre-feedforward norm there, and llama.cpp
# stores every norm weight as (1 + w), which worker/gguf_weights.py turns back into HF's w.
_GEMMA3_NAMES = {**_LAYER_NAMES,
                 "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                 "post_attention_norm.weight": "post_attention_layernorm.weight",
                 "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
                 "attn_q_norm.weight": "self_attn.q_norm.weight",
                 "attn_k_norm.weight": "self_attn.k_norm.weight"}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
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
    if arch == "gemma3":
        _gemma3_config(g, cfg, key)
    elif arch == "gemma2":
        _gemma2_config(g, cfg, key)
    if "rope_freqs.weight" in g.tensors:
        # Llama 3.x GGUFs bake the llama3 rope scaling into a tensor; transformers ignores it too,
        # which only matters beyond the original context length.
        log.warning("%s: ignoring rope_freqs.weight (llama3 rope scaling is not reconstructed)", g.path)
    return cfg


def _gemma3_config(g: GGUFFile, cfg: dict, key) -> None:
    """What a Gemma 3 GGUF leaves to convention (llama.cpp hard-codes these; transformers takes
    Gemma3TextConfig's defaults): every 6th layer global, local rope base 10k, queries scaled by
    query_pre_attn_scalar = head_dim, GeGLU; chat turns end with <end_of_turn>."""
    window, layers = key("attention.sliding_window"), cfg["num_hidden_layers"]
    cfg.update({
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": window,
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
        "query_pre_attn_scalar": 256,  # transformers' default; 256 = head_dim for the sizes up to 12B
        "rope_local_base_freq": 10000.0,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": dict(cfg["rope_parameters"])},
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    })
    _end_of_turn(g, cfg)


def _end_of_turn(g: GGUFFile, cfg: dict) -> None:
    """Gemma's chat turns end with <end_of_turn> (a stop id) where the file names no eot token."""
    tokens = g.fields.get("tokenizer.ggml.tokens") or []
    if "<end_of_turn>" in tokens and not g.fields.get("tokenizer.ggml.eot_token_id"):
        cfg["eot_token_id"] = tokens.index("<end_of_turn>")


def _gemma2_config(g: GGUFFile, cfg: dict, key) -> None:
    """What a Gemma 2 GGUF leaves to convention, as llama.cpp reads it: every second layer local from
    the first, GeGLU, the soft-caps (Gemma2Config's 50 and 30 when the file has none), queries
    scaled by head_dim ** -0.5, except the 27B (46 layers) by (hidden / heads) ** -0.5."""
    layers, hidden, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    cfg.update({
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": key("attention.sliding_window", 4096),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "query_pre_attn_scalar": hidden // heads if layers == 46 else cfg["head_dim"],
        "attn_logit_softcapping": key("attn_logit_softcapping", 50.0),
        "final_logit_softcapping": key("final_logit_softcapping", 30.0),
    })
    _end_of_turn(g, cfg)


def gguf_to_hf_config(gguf_path: str | Path) -> dict:
    """The HF config.json dict describing the model in a GGUF file."""
    return hf_config(GGUFFile(gguf_path))


def hf_name(name: str, arch: str = "llama") -> str | None:
    if m := _BLOCK.fullmatch(name):
        suffix = (_GEMMA3_NAMES if arch in ("gemma2", "gemma3") else _LAYER_NAMES).get(m[2])
        return f"model.layers.{m[1]}.{suffix}" if suffix else None
    return _GLOBAL_NAMES.get(name)


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
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file="model.gguf")
        arch = gguf_arch(g)
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
