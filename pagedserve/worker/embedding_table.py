"""Embedding tables among a model's weights, and the one rule on them: a table (vocabulary x
hidden) is a matmul weight only as the LM head, tied or not; the others are only looked up.
cpu_linear.pack_model (weights packed for the CPU's kernels) and quantized.finalize (int8) both
ask it. parallel.VocabParallelEmbedding is an EmbeddingTable; the type lives here, below parallel
(which imports both of them), so that neither imports parallel.

Threads: read at load only.
"""

from __future__ import annotations

from torch import nn


class EmbeddingTable(nn.Module):
    """The base of a vocabulary-sized table (parallel.VocabParallelEmbedding)."""


def lm_head(model: nn.Module) -> nn.Module | None:
    """The model's LM head: its own, or the input embedding it is tied to."""
    return getattr(model, "lm_head", None) or getattr(model, "embed_tokens", None)


def is_matmul_weight(module: nn.Module, head: nn.Module | None) -> bool:
    """Whether `module`'s weight is multiplied (a linear layer, or the LM head), not only looked up."""
    return not isinstance(module, EmbeddingTable) or module is head
