"""The roofline a kernel is judged against: a GPU model's HBM bandwidth and peak dense bfloat16 FLOP/s,
from the name torch gives the device (`torch.cuda.get_device_name`). kernels.bench and kernels.tune
divide each case's bytes and FLOPs by these to get its floor; `--hbm-gbps` / `--peak-tflops` override.

Datasheet figures (dense, no sparsity). The most specific name is matched first: an "H100 NVL" or an
"H100 PCIe" is not an SXM H100, a "GH200" not an H200. Pure: no torch, no CUDA.
"""

from __future__ import annotations

REFERENCE_GPU = "NVIDIA H200"  # issue 37's figures; the interpreter's nominal floors

# (a substring of the device name, HBM GB/s, bfloat16 dense TFLOP/s), most specific first
PEAKS: tuple[tuple[str, float, float], ...] = (
    ("GH200", 4900.0, 989.0),
    ("H200", 4800.0, 989.0),
    ("H100 NVL", 3900.0, 835.0),
    ("H100 PCIe", 2000.0, 756.0),
    ("H100", 3350.0, 989.0),  # SXM: "NVIDIA H100 80GB HBM3"
    ("H800", 3350.0, 989.0),
    ("B200", 8000.0, 2250.0),
    ("A100-SXM4-80GB", 2039.0, 312.0),
    ("A100 80GB PCIe", 1935.0, 312.0),
    ("A100", 1555.0, 312.0),  # the 40 GB cards
    ("L40S", 864.0, 362.0),
    ("L4", 300.0, 121.0),
    ("A10", 600.0, 125.0),
)


def device_peaks(name: str) -> tuple[float, float] | None:
    """(HBM GB/s, bfloat16 TFLOP/s) of the GPU named `name` (as torch names it, spaces or underscores),
    or None for a GPU not in the table."""
    name = name.replace("_", " ")
    for key, gbps, tflops in PEAKS:
        if key in name:
            return gbps, tflops
    return None


def resolve_peaks(name: str, hbm_gbps: float | None, peak_tflops: float | None) -> tuple[float, float]:
    """The peaks a run uses: the flags where given, else the device's own; an unknown GPU needs both flags."""
    known = device_peaks(name)
    if known is None and (hbm_gbps is None or peak_tflops is None):
        raise SystemExit(f"no roofline for {name!r}: pass --hbm-gbps and --peak-tflops")
    return (hbm_gbps if hbm_gbps is not None else known[0]), (peak_tflops if peak_tflops is not None else known[1])
