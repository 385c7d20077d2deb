"""Idefics3 / SmolVLM's SigLIP vision tower (transformers' Idefics3VisionTransformer) and its connector
(Idefics3Connector: the pixel shuffle, then modality_projection), in plain torch.

Numerics follow transformers: a patch convolution with bias (padding "valid": a tile's pixels past the
last whole patch are dropped), learned position embeddings (no class row), pre-norm encoder layers
(clip.EncoderLayer: layer_norm1, attention with q/k/v/out biases scaled by head_dim ** -0.5, layer_norm2,
fc1, gelu_pytorch_tanh, fc2), then post_layernorm. Only whole, unpadded tiles of image_size x image_size
arrive (the front end splits, resizes and pads), so transformers' patch_attention_mask is all ones and
its attention mask is none. Its position ids for such a tile are NOT always 0..N-1: it buckets the
fractional coordinates i / side against float32 boundaries, and for some sides (19, 25, 29, 31, 38...)
one coordinate falls a bucket short. `tile_position_ids` repeats those very float32 operations, on the
tile's device, so the rows are transformers' for every side. Gemma 3's tower (transformers' SiglipVisionModel,
vision `plain_positions`) is the same tower with position ids 0..N-1, read to its last_hidden_state
(post_layernorm's output: the same as here).

The pixel shuffle is transformers' `pixel_shuffle` verbatim: [tiles, side^2, hidden] ->
[tiles, side^2 / s^2, hidden * s^2], each row s x s neighbouring patches in transformers' order.

Every tensor-parallel rank holds the whole tower and connector and encodes the same tiles itself; the
weights stay float in the serving dtype whatever --quantization says (clip.Linear is not one of the
parallel linears the quantized, packed and LoRA paths look for). Load time and the model runner's step
thread only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.worker.vision.clip import EncoderLayer, LayerNorm, Linear, _param


def tile_position_ids(side: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """transformers' Idefics3VisionEmbeddings position ids for one whole tile of side x side patches
    (its patch_attention_mask all ones), the same float32 operations on `device`: [side * side]."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side, dtype=torch.float32, device=device)
    count = torch.full((1,), side, dtype=torch.long, device=device)  # the mask's row (column) sum
    step = 1.0 / count
    coords = torch.arange(side, dtype=torch.float32, device=device)[None, :] * step[:, None]
    buckets = torch.bucketize(torch.clamp(coords, max=1.0 - 1e-6), boundaries, right=True)[0]
    return (buckets[:, None] * side + buckets[None, :]).reshape(-1)


class SiglipEmbeddings(nn.Module):
    def __init__(self, v: dict) -> None:
        super().__init__()
        hidden, patch = v["hidden_size"], v["patch_size"]
        self.patch_size, self.side = patch, v["image_size"] // patch
        self.patch_embedding = nn.Module()
        self.patch_embedding.weight = _param(hidden, v["num_channels"], patch, patch)
        self.patch_embedding.bias = _param(hidden)
        self.position_embedding = nn.Module()
        self.position_embedding.weight = _param(self.side * self.side, hidden)
        self.plain = bool(v.get("plain_positions"))  # SiglipVisionModel's (Gemma 3's): 0..N-1
        self._positions: dict[torch.device, torch.Tensor] = {}

    def positions(self, device: torch.device) -> torch.Tensor:
        if device not in self._positions:
            self._positions[device] = (torch.arange(self.side * self.side, device=device) if self.plain
                                       else tile_position_ids(self.side, device))
        return self._positions[device]

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        if pixels.shape[-2] // self.patch_size != self.side or pixels.shape[-1] // self.patch_size != self.side:
            raise ValueError(f"a tile of {pixels.shape[-2]}x{pixels.shape[-1]} pixels: the tower takes "
                             f"{self.side}x{self.side} patches of {self.patch_size}")
        patches = F.conv2d(pixels, self.patch_embedding.weight, self.patch_embedding.bias, stride=self.patch_size)
        patches = patches.flatten(2).transpose(1, 2)
        return patches + self.position_embedding.weight[self.positions(pixels.device)]


class SiglipVisionTower(nn.Module):
    """pixels [tiles, channels, image_size, image_size] -> post_layernorm's output [tiles, side^2, hidden]
    (vision: ModelConfig.vision). Parameter names are the checkpoint's under `vision_model.`."""

    def __init__(self, vision: dict) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(vision)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(EncoderLayer(vision) for _ in range(vision["num_hidden_layers"]))
        self.post_layernorm = LayerNorm(vision["hidden_size"], vision["layer_norm_eps"])

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(pixels.to(self.post_layernorm.weight.dtype))
        for layer in self.encoder.layers:
            hidden = layer(hidden)
        return self.post_layernorm(hidden)

    def map_name(self, name: str) -> tuple[str, int] | None:
        """`vision_model.<checkpoint name>` -> (our parameter name, 0), None for buffers we compute."""
        return None if "position_ids" in name else (name, 0)


def pixel_shuffle(x: torch.Tensor, scale_factor: int) -> torch.Tensor:
    """transformers' Idefics3Connector.pixel_shuffle, step for step."""
    bsz, seq, embed_dim = x.size()
    height = width = int(seq**0.5)
    x = x.view(bsz, height, width, embed_dim)
    x = x.view(bsz, height, int(width / scale_factor), embed_dim * scale_factor)
    x = x.permute(0, 2, 1, 3)
    x = x.reshape(bsz, int(width / scale_factor), int(height / scale_factor), embed_dim * (scale_factor**2))
    x = x.permute(0, 2, 1, 3)
    return x.reshape(bsz, int(seq / (scale_factor**2)), embed_dim * (scale_factor**2))


class Connector(nn.Module):
    """Idefics3Connector: the pixel shuffle, then modality_projection.proj (no bias) to the text hidden size:
    [tiles, side^2, hidden] -> [tiles, num_image_tokens, text hidden]."""

    def __init__(self, vision: dict, text_hidden: int) -> None:
        super().__init__()
        self.scale_factor = vision["scale_factor"]
        self.modality_projection = nn.Module()
        self.modality_projection.proj = Linear(vision["hidden_size"] * self.scale_factor ** 2, text_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.modality_projection.proj(pixel_shuffle(x, self.scale_factor))
