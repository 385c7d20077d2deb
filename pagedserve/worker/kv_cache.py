"""The device KV block pool (and the host pool that swapped blocks go to)."""

from __future__ import annotations

import logging

import torch

from pagedserve.common.model_config import ModelConfig

log = logging.getLogger(__name__)


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, tensor_parallel_size: int = 1) -> int:
    """One block's bytes on one rank, all layers."""
    elem = torch.empty((), dtype=dtype).element_size()
    layout = cfg.kv_layout(tensor_parallel_size)
    return layout.num_planes * cfg.num_hidden_layers * block_size * layout.num_heads * layout.head_dim * elem


class KVCache:
    """All layers' blocks in one tensor [layers, planes (K/V, or MLA's one latent), blocks,
    block_size, kv_heads, head_dim], so a block copy or swap moves every layer's slice in one
    indexed copy."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, num_host_blocks: int = 0, tensor_parallel_size: int = 1) -> None:
        layout = cfg.kv_layout(tensor_parallel_size)
        shape = (cfg.num_hidden_layers, layout.num_planes, num_blocks, block_size, layout.num_heads, layout.head_dim)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.host_cache = None
        if num_host_blocks:
            host_shape = shape[:2] + (num_host_blocks,) + shape[3:]
            pin = device.type == "cuda"
            self.host_cache = torch.zeros(host_shape, dtype=dtype, pin_memory=pin)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            src, dst = _index(pairs, self.device_cache.device)
            self.device_cache[:, :, dst] = self.device_cache[:, :, src]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            dev, host = (torch.tensor(x) for x in zip(*pairs))
            self.host_cache[:, :, host] = self.device_cache[:, :, dev.to(self.device_cache.device)].cpu()

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            host, dev = (torch.tensor(x) for x in zip(*pairs))
            self.device_cache[:, :, dev.to(self.device_cache.device)] = \
                self.host_cache[:, :, host].to(self.device_cache.device)


def _index(pairs, device):
    src, dst = zip(*pairs)
    return torch.tensor(src, device=device), torch.tensor(dst, device=device)
