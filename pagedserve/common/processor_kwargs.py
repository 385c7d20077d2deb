"""--mm-processor-kwargs (vLLM's flag; `LLM(..., mm_processor_kwargs={...})`): overrides of the model's image
processor settings, laid over the folder's preprocessor_config.json here, in the one function every reader
of that file calls (`preprocessor`): the front end's image config (model_files/image_processing.image_config:
the tokenizer service, LLM, AsyncLLM) and the worker's vision settings (ModelConfig.from_folder: the worker,
the in-process engine). Both sides read the same merged dict, so they cannot disagree on an image's bounds.

The keys each family's processor takes (FAMILY_KEYS):

    Qwen2-VL / Qwen2.5-VL   min_pixels, max_pixels; transformers 5's size {"shortest_edge", "longest_edge"}
                            (pixels: the same bounds, either edge alone); an override's bounds replace the
                            file's whichever spelling the file uses (transformers, given a hub file's
                            min_pixels / max_pixels and a size kwarg, keeps the file's: here the flag wins)
    Idefics3 / SmolVLM      size {"longest_edge"}, max_image_size {"longest_edge"}, do_image_splitting
    Pixtral / Mistral 3     size {"longest_edge"} (or {"height", "width"})
    LLaVA, Gemma 3          none: their processors' sizes are fixed by the tower

Refusals are ValueError at startup, naming the key: a key the model's processor does not take (vLLM only
warns and drops it; failing loudly was chosen because a silently dropped bound changes every image's token
count without a word, the opposite of what the operator asked for), a value of the wrong type, a Qwen2-VL
range with min_pixels over max_pixels or max_pixels under one merged patch. What the tower cannot take
(an Idefics3 tile that is not the tower's, a Pixtral side past its image_size) is refused by the family's own
checks (image_processing.py), as for the folder's own file, with the override named. A text model with the
flag set is refused ("this model takes no images"): an operator who set it expects images to be bounded.

Standard library only (the tokenizer service imports this; no torch).
"""

from __future__ import annotations

import json
from pathlib import Path

from pagedserve.common.pixtral_config import is_pixtral
from pagedserve.common.vision_config import (GEMMA3_ARCHITECTURES, IDEFICS3_ARCHITECTURES, QWEN2_VL_ARCHITECTURES,
                                             image_normalization, qwen2_vl_parts)

FLAG = "--mm-processor-kwargs"
FAMILY_KEYS = {"qwen2_vl": ("min_pixels", "max_pixels", "size"),
               "idefics3": ("size", "max_image_size", "do_image_splitting"),
               "pixtral": ("size",), "llava": (), "gemma3": ()}
# the edges a `size` (or max_image_size) override may name, per family
SIZE_EDGES = {"qwen2_vl": ("shortest_edge", "longest_edge"), "idefics3": ("longest_edge", "height", "width"),
              "pixtral": ("longest_edge", "height", "width")}


def parse(value: str | dict | None) -> dict:
    """The overrides as a dict: a JSON object (the flag's text) or a dict (LLM's keyword); {} when unset."""
    if value is None or value == "" or value == {}:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"{FLAG} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{FLAG} must be a JSON object of processor settings, got {value!r}")
    return dict(value)


def family(config: dict) -> str | None:
    """The image family of a config.json (FAMILY_KEYS' names), None for a text model."""
    archs = set(config.get("architectures") or ())
    if archs & set(GEMMA3_ARCHITECTURES):
        return "gemma3"
    if is_pixtral(config):
        return "pixtral"
    if archs & set(QWEN2_VL_ARCHITECTURES):
        return "qwen2_vl"
    if archs & set(IDEFICS3_ARCHITECTURES):
        return "idefics3"
    return "llava" if "LlavaForConditionalGeneration" in archs else None


def _positive(key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{FLAG}: {key} must be a positive integer, got {value!r}")
    return value


def _edges(key: str, value, edges: tuple[str, ...]) -> dict:
    if not isinstance(value, dict) or not value or set(value) - set(edges):
        raise ValueError(f"{FLAG}: {key} must be an object of {', '.join(edges)}, got {value!r}")
    return {edge: _positive(f"{key}.{edge}", v) for edge, v in value.items()}


def _checked(name: str, overrides: dict) -> dict:
    """The overrides with each key known to the family and each value of its type."""
    if name is None:
        raise ValueError(f"{FLAG} is set but this model takes no images")
    out = {}
    for key, value in overrides.items():
        if key not in FAMILY_KEYS[name]:
            takes = ", ".join(FAMILY_KEYS[name]) or "none"
            raise ValueError(f"{FLAG}: {key!r} is not a setting of this model's image processor (it takes: {takes})")
        if key in ("min_pixels", "max_pixels"):
            out[key] = _positive(key, value)
        elif key == "do_image_splitting":
            if not isinstance(value, bool):
                raise ValueError(f"{FLAG}: do_image_splitting must be true or false, got {value!r}")
            out[key] = value
        else:  # size, max_image_size
            out[key] = _edges(key, value, SIZE_EDGES[name] if key == "size" else ("longest_edge",))
    return out


def apply(pre: dict, config: dict, overrides: dict) -> dict:
    """preprocessor_config.json's fields (pre) with the overrides laid over them, for the model whose config.json
    is config; pre itself when there are none. ValueError naming the key for what the module docstring lists."""
    if not overrides:
        return pre
    name = family(config)
    given = _checked(name, overrides)
    merged = {**pre, **given}
    if name == "qwen2_vl":  # one spelling: min_pixels / max_pixels, which image_normalization reads first
        size = given.pop("size", {})
        if size:
            del merged["size"]
        bounds = {"min_pixels": size.get("shortest_edge"), "max_pixels": size.get("longest_edge")}
        vision = qwen2_vl_parts(config)[1]
        now = image_normalization(pre, vision)
        for key in ("min_pixels", "max_pixels"):
            merged[key] = given.get(key) or bounds[key] or now[key]
        low, high = merged["min_pixels"], merged["max_pixels"]
        if low > high:
            raise ValueError(f"{FLAG}: min_pixels {low} is over max_pixels {high}")
        smallest = (vision["patch_size"] * vision["merge_size"]) ** 2
        if high < smallest:
            raise ValueError(f"{FLAG}: max_pixels {high} is under the tower's smallest image ({smallest} pixels)")
    return merged


def read_json(path: Path) -> dict:
    """A JSON file's object ({} when there is no such file)."""
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except ValueError as exc:
        raise ValueError(f"{path.name} is not JSON: {exc}") from None


def preprocessor(folder: str | Path, config: dict, mm_processor_kwargs: str | dict | None = None) -> dict:
    """The folder's preprocessor_config.json with --mm-processor-kwargs laid over it (apply): what the front end
    and the worker both read."""
    return apply(read_json(Path(folder) / "preprocessor_config.json"), config, parse(mm_processor_kwargs))


def named(exc: ValueError, mm_processor_kwargs: str | dict | None) -> ValueError:
    """exc, saying which overrides were laid over the file when there were any (a family's own check failed)."""
    given = parse(mm_processor_kwargs)
    if not given or str(exc).startswith(FLAG):
        return exc
    return ValueError(f"{exc} (with {FLAG} {json.dumps(given)})")
