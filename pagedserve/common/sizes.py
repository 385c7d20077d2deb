"""Byte sizes as people write them: '512MiB', '2GiB', '1.5G' or a plain count (the worker's
--kv-cache-memory and --swap-space, and the planner's pool sizes, read them alike)."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


def parse_size(text: str | int) -> int:
    """'512MiB', '2GiB', '1.5G' or a plain byte count."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use a byte count or e.g. 512MiB, 2GiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
