"""CPU kernels compiled from pagedserve/kernels/cpu/*.cpp on first use (g++ and torch's headers), cached
per source and CPU so a changed file or another processor builds afresh."""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)
_SOURCES = [Path(__file__).parent / "cpu" / name
            for name in ("bindings.cpp", "paged_attention.cpp", "prefill_attention.cpp", "lane_linear.cpp",
                         "fused_ops.cpp", "quant_linear.cpp", "quant_repack.cpp", "logits_ops.cpp",
                         "dequant_lane.cpp", "lora_delta.cpp", "work_pool.cpp", "seeded_race.cpp")]
_HEADERS = [Path(__file__).parent / "cpu" / name
            for name in ("simd.h", "parallel_grain.h", "head_dims.h", "lane_linear.h", "quant_blocks.h", "work_pool.h")]


@cache
def cpu_flags() -> str:
    """This CPU's flags line of /proc/cpuinfo (empty when there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 itself (avx512_bf16 or AMX): the dtype choice's test."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


@cache
def load():
    """The compiled module, or None (with a warning) when it cannot be built here."""
    if os.environ.get("PAGEDSERVE_NO_CPU_KERNELS"):
        return None
    import torch
    from torch.utils.cpp_extension import load as load_extension

    text = b"".join(p.read_bytes() for p in _SOURCES + _HEADERS)
    # torch's path too: two environments' build commands differ (their include paths), so sharing one
    # folder each would take the other's build for a stale one and rebuild it, under the folder's lock.
    digest = hashlib.sha256(text + cpu_flags().encode() + torch.__version__.encode()
                            + torch.__file__.encode()).hexdigest()[:12]
    name = f"pagedserve_cpu_{digest}"
    build_dir = Path(os.environ.get("PAGEDSERVE_DATA_DIR", Path.home() / ".cache" / "pagedserve")) / "kernels" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        sources = _stable_sources(build_dir)
        _prefer_own_ninja()
        return load_extension(name, [str(p) for p in sources], build_directory=str(build_dir),
                              extra_cflags=["-O3", "-march=native", "-fopenmp"],
                              extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # a missing compiler must not stop serving: fall back to torch ops
        log.warning("CPU attention kernel unavailable (%s); using the slower torch path", exc)
        return None


def _prefer_own_ninja() -> None:
    """torch builds with the first `ninja` on PATH. A process started from the virtual environment's
    python without activating it found the system's (1.11 here) where an activated one found the
    environment's (1.13): the two hash build commands differently, so each took the other's build for
    a stale one and recompiled everything (~75 s, under the folder's lock). The ninja beside this
    python, when there is one, goes first on PATH, so every process of one environment builds alike."""
    own = Path(sys.executable).parent
    path = os.environ.get("PATH", "")
    if (own / "ninja").exists() and path.split(os.pathsep)[0] != str(own):
        os.environ["PATH"] = str(own) + os.pathsep + path


def _stable_sources(build_dir: Path) -> list[Path]:
    """The sources copied into the build folder (once: the folder's name is their digest), so every
    checkout of the same sources compiles the same paths: torch's build file names each source by its
    path, and two checkouts (git worktrees, or an installed copy beside a checkout) loading one build
    folder each saw the other's paths as a change and recompiled everything, holding the folder's
    lock for a minute each time."""
    src = build_dir / "src"
    src.mkdir(exist_ok=True)
    for path in _SOURCES + _HEADERS:
        target = src / path.name
        if not target.exists() or target.read_bytes() != path.read_bytes():
            tmp = target.with_suffix(target.suffix + f".{os.getpid()}")
            tmp.write_bytes(path.read_bytes())
            os.replace(tmp, target)
    return [src / p.name for p in _SOURCES]
