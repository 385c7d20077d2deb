"""LoRA adapters as PEFT saves them, read and checked without torch (the gateway checks a folder
before it registers it; the worker reads the same spec before it loads the tensors).

A PEFT folder holds `adapter_config.json` (r, lora_alpha, use_rslora, target_modules,
rank_pattern, alpha_pattern) and `adapter_model.safetensors` with, per adapted projection,
`base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r]. The delta
of a projection is scaling * B @ A, scaling = lora_alpha / r (rslora: lora_alpha / sqrt(r)).

What is served: the attention and MLP projections (TARGET_MODULES), ranks up to
--max-lora-rank. Refused with a LoraError naming the reason: DoRA, trained biases,
modules_to_save (a replaced embedding or head), fan_in_fan_out weights, embedding adapters,
any other module. `LoraRequest` is vLLM's (lora_name, lora_int_id, lora_path).

Pure functions and frozen records: safe from any thread.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_PREFIX = "base_model.model."
DEFAULT_MAX_LORAS = 1  # vLLM's defaults
DEFAULT_MAX_LORA_RANK = 16
MAX_NAME = 128


class LoraError(ValueError):
    """An adapter that cannot be served; status: the HTTP status a client gets (400, or 404
    for a name or folder that does not exist)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class LoraRequest:
    """vLLM's LoRARequest: an adapter by name, with its folder."""
    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


@dataclass(frozen=True, slots=True)
class ModuleLora:
    """One adapted projection: its PEFT module name (`model.layers.0.self_attn.q_proj`), rank
    and scaling."""
    module: str
    rank: int
    scaling: float


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    name: str
    path: str
    rank: int  # the largest of its modules'
    modules: tuple[ModuleLora, ...]

    @property
    def weights_file(self) -> Path:
        return Path(self.path) / WEIGHTS_FILE


def parse_lora_modules(values: list[str] | None) -> dict[str, str]:
    """--lora-modules entries `name=path` (repeatable; vLLM also takes a JSON object with
    name and path) -> {name: path}."""
    out: dict[str, str] = {}
    for value in values or ():
        text = value.strip()
        if text.startswith("{"):
            try:
                obj = json.loads(text)
                name, path = obj["name"], obj["path"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--lora-modules {value!r}: a JSON entry needs \"name\" and \"path\"") from None
        else:
            name, sep, path = text.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {value!r}: expected name=path")
        check_name(name)
        if name in out:
            raise ValueError(f"--lora-modules names {name!r} twice")
        out[name] = path
    return out


def check_name(name: object) -> str:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME or any(c.isspace() for c in name):
        raise LoraError(f"lora_name must be a non-empty string of at most {MAX_NAME} characters without "
                        f"spaces, got {name!r}")
    return name


def safetensors_header(path: Path) -> dict:
    """The tensors' names -> {dtype, shape, data_offsets} of a .safetensors file, from its header."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise LoraError(f"{path} is not a safetensors file (too short)")
        (size,) = struct.unpack("<Q", head)
        if size > 1 << 26:
            raise LoraError(f"{path} is not a safetensors file (header of {size} bytes)")
        try:
            header = json.loads(f.read(size))
        except ValueError:
            raise LoraError(f"{path} is not a safetensors file (unreadable header)") from None
    header.pop("__metadata__", None)
    return header


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: a key matches a module whose name ends with it."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def read_adapter(name: str, path: str | Path, max_rank: int) -> AdapterSpec:
    """The adapter at path, checked; LoraError (404: no such folder or files; 400: what cannot be
    served) otherwise."""
    check_name(name)
    folder = Path(path)
    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not folder.is_dir():
        raise LoraError(f"LoRA adapter {name!r}: no folder {str(path)!r}", 404)
    for needed in (config_path, weights_path):
        if not needed.is_file():
            raise LoraError(f"LoRA adapter {name!r}: {str(path)!r} has no {needed.name} (a PEFT folder holds "
                            f"{CONFIG_FILE} and {WEIGHTS_FILE})", 404)
    try:
        config = json.loads(config_path.read_text())
    except ValueError as exc:
        raise LoraError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not JSON ({exc})") from None
    refused = [what for what, bad in (
        ("DoRA (use_dora)", config.get("use_dora")), ("trained biases (bias)", config.get("bias", "none") != "none"),
        ("modules_to_save", config.get("modules_to_save")), ("fan_in_fan_out", config.get("fan_in_fan_out")),
    ) if bad]
    if config.get("peft_type", "LORA") != "LORA":
        refused.append(f"peft_type {config.get('peft_type')!r}")
    if refused:
        raise LoraError(f"LoRA adapter {name!r}: not supported: {', '.join(refused)}")
    header = safetensors_header(weights_path)
    modules = _modules(name, config, header, max_rank)
    return AdapterSpec(name, str(folder), max(m.rank for m in modules), tuple(modules))


def _modules(name: str, config: dict, header: dict, max_rank: int) -> list[ModuleLora]:
    default_r, default_alpha = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
    rslora = bool(config.get("use_rslora"))
    found: dict[str, dict[str, list[int]]] = {}
    for key, info in header.items():
        match = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.(lora_A|lora_B)(?:\.default)?\.weight", key)
        if match is None:
            raise LoraError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA A/B weight of a projection "
                            f"(served: {', '.join(TARGET_MODULES)})")
        module, which = match.groups()
        if module.rsplit(".", 1)[-1] not in TARGET_MODULES:
            raise LoraError(f"LoRA adapter {name!r}: module {module!r} is not served: the target modules are "
                            f"{', '.join(TARGET_MODULES)}")
        found.setdefault(module, {})[which] = list(info["shape"])
    if not found:
        raise LoraError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    out = []
    for module, shapes in sorted(found.items()):
        if set(shapes) != {"lora_A", "lora_B"}:
            raise LoraError(f"LoRA adapter {name!r}: module {module!r} lacks its "
                            f"{'lora_B' if 'lora_A' in shapes else 'lora_A'} weight")
        a, b = shapes["lora_A"], shapes["lora_B"]
        if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
            raise LoraError(f"LoRA adapter {name!r}: module {module!r} has lora_A {a} and lora_B {b}: "
                            "expected [r, in] and [out, r]")
        rank = a[0]
        if rank > max_rank:
            raise LoraError(f"LoRA adapter {name!r}: rank {rank} of {module!r} is over --max-lora-rank {max_rank}")
        alpha = float(_pattern_value(config.get("alpha_pattern"), module, default_alpha))
        expected_r = int(_pattern_value(config.get("rank_pattern"), module, default_r))
        if expected_r != rank:
            raise LoraError(f"LoRA adapter {name!r}: {module!r} has rank {rank}, its config says {expected_r}")
        out.append(ModuleLora(module, rank, alpha / (math.sqrt(rank) if rslora else rank)))
    return out
