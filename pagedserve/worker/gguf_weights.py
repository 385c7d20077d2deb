"""A GGUF file's weights, dequantized into HF names and layout (the parsing is in
pagedserve.model_files.gguf_loader, which stays free of torch)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from pagedserve.model_files.gguf_loader import ARCHITECTURES, GGUFFile, gguf_arch, hf_config, hf_name


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # llama.cpp interleaves the two rotary halves of each head; HF keeps them as contiguous halves.
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def iter_gguf_weights(gguf_path: str | Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF parameter name, tensor) for every weight, dequantized and in HF layout.

    The file is opened and checked here, so a bad file fails at the call, not mid-load.
    """
    g = GGUFFile(gguf_path)
    cfg = hf_config(g)
    arch = gguf_arch(g)
    names = {name: hf_name(name, arch) for name in g.tensors if name != "rope_freqs.weight"}
    if unknown := [name for name, mapped in names.items() if mapped is None]:
        raise ValueError(f"{g.path}: unexpected tensors {unknown[:5]}")
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    permuted = ARCHITECTURES[arch][2]
    # llama.cpp stores Gemma's zero-centred norm weights as 1 + w; HF (and our model) keep w.
    # Subtracted in float32 as transformers' GGUF loader does, so the weights are identical.
    shifted_norms = arch == "gemma3"

    def weights():
        for name, mapped in names.items():
            array = g.dequantized(name)
            if shifted_norms and name.endswith("norm.weight"):
                array = array - 1
            w = torch.from_numpy(array)
            kind = name.split(".")[-2]
            if permuted and kind in heads:
                w = _unpermute(w, heads[kind])
            yield mapped, w.to(dtype)

    return weights()
