"""The device KV block pool (and the host pool that swapped blocks go to).

With KV groups (common/model_config.KVGroups) the first dimension is the group's layer slots,
not the layers: block b of slot s holds layer `groups.layers[g][s]` for whichever group g owns
block b (the scheduler's block manager hands each id to one group at a time). A model with one
group has a slot per layer: the plain layout."""

from __future__ import annotations

import logging

import torch

from pagedserve.common.model_config import ModelConfig

log = logging.getLogger(__name__)


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, tensor_parallel_size: int = 1) -> int:
    """One block's bytes on one rank: all layer slots (every layer, for a model with one KV group)."""
    elem = torch.empty((), dtype=dtype).element_size()
    layout = cfg.kv_layout(tensor_parallel_size)
    return layout.num_planes * cfg.kv_groups().num_slots * block_size * layout.num_heads * layout.head_dim * elem


class KVCache:
    """All layers' blocks in one tensor [layer slots, planes (K/V, or MLA's one latent), blocks,
    block_size, kv_heads, head_dim], so a block copy or swap moves every layer's slice in one
    indexed copy."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, num_host_blocks: int = 0, tensor_parallel_size: int = 1) -> None:
        layout = cfg.kv_layout(tensor_parallel_size)
        self.groups = cfg.kv_groups()
        shape = (self.groups.num_slots, layout.num_planes, num_blocks, block_size, layout.num_heads, layout.head_dim)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device_cache = torch.zeros(shape, dtype=dtype, device=device)
        self._layer_views: list[tuple[torch.Tensor, ...]] | None = None
        self.host_cache = None
        if num_host_blocks:
            host_shape = shape[:2] + (num_host_blocks,) + shape[3:]
            pin = device.type == "cuda"
            self.host_cache = torch.zeros(host_shape, dtype=dtype, pin_memory=pin)

    def model_caches(self) -> list[tuple[torch.Tensor, ...]]:
        """What the model indexes by layer, then by plane: per layer its slot's planes (K and V, or
        MLA's one latent) as views of the one tensor. Made once: indexing the tensor anew per layer
        and step cost three ops a layer of a one-token step."""
        if self._layer_views is None:
            slots = self.groups.slot_of() if self.groups.hybrid else None
            self._layer_views = [tuple(self.device_cache[slots[layer][1] if slots else layer].unbind(0))
                                 for layer in range(len(slots) if slots else self.device_cache.shape[0])]
        return self._layer_views

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
