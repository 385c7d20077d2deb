"""A GGUF file's weights in HF names and layout: dequantized, or (keep_quantized) the 2-D weights
of a format the CPU kernels read as their blocks (worker.quantized.QuantizedTensor). The parsing is
in pagedserve.model_files.gguf_loader, which stays free of torch."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from pagedserve.model_files.gguf_loader import ARCHITECTURES, GGUFFile, gguf_arch, hf_config, hf_name
from pagedserve.worker.quantized import KERNEL_TYPES, QuantizedTensor


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # llama.cpp interleaves the two rotary halves of each head; HF keeps them as contiguous halves.
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def iter_gguf_weights(gguf_path: str | Path, dtype: torch.dtype,
                      keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """(HF parameter name, tensor) for every weight, in HF layout: dequantized, or with
    keep_quantized the 2-D weights in Q4_0/Q4_1/Q8_0/Q4_K/Q6_K as their blocks.

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
    shifted_norms = arch in ("gemma2", "gemma3")

    def weights():
        for name, mapped in names.items():
            kind = name.split(".")[-2]
            info = g.tensors[name]
            if keep_quantized and len(info.dims) == 2 and info.qtype in KERNEL_TYPES:
                # The blocks are copied out of the memory map (it is read-only and is closed later).
                w = QuantizedTensor(torch.from_numpy(g.blocks(name).copy()), info.qtype, info.dims[0])
                if permuted and kind in heads:  # a permutation of whole rows: blocks move intact
                    w = w.permute_rows(_unpermute(torch.arange(info.dims[1]), heads[kind]))
                yield mapped, w
                continue
            array = g.dequantized(name)
            if shifted_norms and name.endswith("norm.weight"):
                array = array - 1
            w = torch.from_numpy(array)
            if permuted and kind in heads:
                w = _unpermute(w, heads[kind])
            yield mapped, w.to(dtype)

    return weights()
