"""The load-time choices of worker/model_setup.py that depend on the CPU: which dtype `auto` picks,
and the warning a user gets for bfloat16 where the CPU has no bfloat16 arithmetic."""

from __future__ import annotations

import logging

import pytest
import torch

from pagedserve.worker.model_setup import cpu_has_fast_bf16, pick_dtype

CPU = torch.device("cpu")


def test_auto_picks_bfloat16_only_where_the_cpu_computes_in_it():
    assert pick_dtype("auto", CPU) == (torch.bfloat16 if cpu_has_fast_bf16() else torch.float32)


def test_bfloat16_without_hardware_support_is_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="pagedserve"):
        assert pick_dtype("bfloat16", CPU) == torch.bfloat16
        assert pick_dtype("float32", CPU) == torch.float32
    warned = [r.getMessage() for r in caplog.records if "avx512_bf16" in r.getMessage()]
    assert len(warned) == (0 if cpu_has_fast_bf16() else 1), warned


def test_unknown_dtype_is_named():
    with pytest.raises(ValueError, match="got 'float8'"):
        pick_dtype("float8", CPU)
