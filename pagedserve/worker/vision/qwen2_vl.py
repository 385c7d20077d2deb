"""Qwen2-VL's and Qwen2.5-VL's vision towers (transformers' Qwen2VisionTransformerPretrainedModel and
Qwen2_5_VisionTransformerPretrainedModel, the PatchMerger included), in plain torch, over images at their own
resolution.

An ImageInput (RGB uint8, height x width, both multiples of patch_size * merge_size) is normalized (rescale,
mean, std), cut into patch_size patches in the processor's order (Qwen2VLImageProcessor's patchify: merge
windows of merge_size x merge_size patches, row-major, each window's patches row-major), each patch its frame
twice over temporal_patch_size (a still image, as the processor repeats it) through the Conv3d patch
embedding (one matmul over the flattened patch, the kernel summed over its temporal axis: the same frame each
time). Blocks: pre-norm attention with 2D rotary (a patch's height and width indices, each turning half the
rotary frequencies), then the MLP. Qwen2-VL: LayerNorm, QuickGELU fc1/fc2. Qwen2.5-VL: RMSNorm, SwiGLU with
biases, and attention within windows of window_size pixels (the patches reordered window by window first)
except at fullatt_block_indexes; the merged rows are put back in the image's order after the merger. The
merger: a norm, then merge_size^2 patches' rows as one, through a 2-layer GELU MLP: (height / factor) *
(width / factor) rows an image, of out_hidden_size.

Several images go through in one pass: attention runs per segment (an image, or a window of one), segments of
equal length batched in one scaled_dot_product_attention; no image sees another. Every tensor-parallel rank
holds the whole tower and encodes the same images itself; weights stay float in the serving dtype. Load time
and the model runner's step thread only.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.worker.ops import rms_norm_native
from pagedserve.worker.vision.clip import LayerNorm, Linear, _param, activation

ROPE_THETA = 10000.0  # the towers' axial rotary base (transformers' vision rope_parameters default)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = _param(size), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_native(x, self.weight, self.eps)


def _norm(v: dict, size: int) -> nn.Module:
    return RMSNorm(size, 1e-6) if v["family"] == "qwen2_5_vl" else LayerNorm(size, 1e-6)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def segments(bounds: list[int], device: torch.device) -> list[tuple[int, int, torch.Tensor | int]]:
    """Segments bounds[i]..bounds[i + 1] grouped by length: (length, how many, their rows in order; or the
    start, for a length only one segment has: a slice). Built once a pass, read by every block."""
    by_length: dict[int, list[int]] = defaultdict(list)
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            by_length[end - start].append(start)
    return [(length, len(starts), starts[0] if len(starts) == 1 else
             (torch.tensor(starts)[:, None] + torch.arange(length)).reshape(-1).to(device))
            for length, starts in by_length.items()]


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups, scale: float) -> torch.Tensor:
    """q, k, v [tokens, heads, head_dim]; each segment of `groups` (segments()) attends to itself only,
    segments of one length in one batch."""
    out = torch.empty_like(q)
    for length, count, rows in groups:
        if isinstance(rows, int):
            qs, ks, vs = (t[None, rows:rows + length].transpose(1, 2) for t in (q, k, v))  # 4-D: the CPU's
            out[rows:rows + length] = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)[0].transpose(0, 1)
            continue  # flash kernel (3-D inputs take the math path)
        qs, ks, vs = (t[rows].view(count, length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        out[rows] = F.scaled_dot_product_attention(qs, ks, vs, scale=scale).transpose(1, 2).reshape(-1, *q.shape[1:])
    return out


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv, self.proj = Linear(dim, 3 * dim), Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = ((t.float() * cos + _rotate_half(t.float()) * sin).to(x.dtype) for t in (q, k))  # in float32
        return self.proj(segment_attention(q, k, v, groups, self.head_dim ** -0.5).reshape(n, -1))


class MLP(nn.Module):
    """Qwen2-VL's fc1, activation, fc2."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1, self.fc2, self.act = Linear(dim, hidden), Linear(hidden, dim), activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class GatedMLP(nn.Module):
    """Qwen2.5-VL's down(act(gate(x)) * up(x)), biases on all three."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = Linear(dim, hidden), Linear(dim, hidden)
        self.down_proj, self.act = Linear(hidden, dim), activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, v: dict) -> None:
        super().__init__()
        dim = v["embed_dim"]
        self.norm1, self.norm2 = _norm(v, dim), _norm(v, dim)
        self.attn = Attention(dim, v["num_heads"])
        mlp = GatedMLP if v["family"] == "qwen2_5_vl" else MLP
        self.mlp = mlp(dim, v["intermediate_size"], v["hidden_act"])

    def forward(self, x, cos, sin, groups):
        x = x + self.attn(self.norm1(x), cos, sin, groups)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, v: dict) -> None:
        super().__init__()
        self.width = v["embed_dim"] * v["merge_size"] ** 2
        self.ln_q = _norm(v, v["embed_dim"])
        self.mlp = nn.Sequential(Linear(self.width, self.width), nn.GELU(), Linear(self.width, v["out_hidden_size"]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class Qwen2VLVisionTower(nn.Module):
    """ImageInputs -> each one's rows [(height / factor) * (width / factor), out_hidden_size] (vision:
    ModelConfig.vision). Parameter names are the checkpoint's under `visual.`."""

    def __init__(self, vision: dict) -> None:
        super().__init__()
        self.v = v = vision
        self.patch, self.merge, self.temporal = v["patch_size"], v["merge_size"], v["temporal_patch_size"]
        self.windowed = v["family"] == "qwen2_5_vl"
        self.full_blocks = set(v["fullatt_block_indexes"]) if self.windowed else set(range(v["depth"]))
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Module()
        self.patch_embed.proj.weight = _param(v["embed_dim"], v["num_channels"], self.temporal, self.patch, self.patch)
        self.blocks = nn.ModuleList(Block(v) for _ in range(v["depth"]))
        self.merger = PatchMerger(v)
        half = v["embed_dim"] // v["num_heads"] // 2  # each axis turns half of the rotary's frequencies
        self.register_buffer("inv_freq", 1.0 / ROPE_THETA ** (torch.arange(0, half, 2, dtype=torch.float32) / half),
                             persistent=False)

    def rows_of(self, image) -> int:
        """The rows an image of its size encodes into: one per merge_size x merge_size patches."""
        return (image.height // self.patch) * (image.width // self.patch) // self.merge ** 2

    def patches(self, image, device: torch.device) -> torch.Tensor:
        """[patches, channels * patch * patch] of one image, normalized, in the processor's order."""
        v, p, m = self.v, self.patch, self.merge
        h, w = image.height, image.width
        raw = torch.frombuffer(bytearray(image.data), dtype=torch.uint8).view(h, w, 3).to(device)
        mean = torch.tensor(v["image_mean"], dtype=torch.float32, device=device)
        std = torch.tensor(v["image_std"], dtype=torch.float32, device=device)
        pixels = ((raw.float() * v["rescale_factor"] - mean) / std).permute(2, 0, 1)
        grid = pixels.reshape(3, h // p // m, m, p, w // p // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
        return grid.reshape(-1, 3, p, p)

    def rotary(self, rows: int, cols: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [patches, 1, head_dim] of an image of rows x cols patches, in the patches' order."""
        m = self.merge
        hpos = torch.arange(rows, device=device)[:, None].expand(rows, cols)
        wpos = torch.arange(cols, device=device)[None, :].expand(rows, cols)
        order = lambda t: t.reshape(rows // m, m, cols // m, m).transpose(1, 2).reshape(-1)  # noqa: E731
        freqs = torch.cat([order(hpos)[:, None] * self.inv_freq, order(wpos)[:, None] * self.inv_freq], dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]
        return emb.cos(), emb.sin()

    def windows(self, rows: int, cols: int) -> tuple[torch.Tensor, list[int]]:
        """Qwen2.5-VL: (the merged units' window order, each window's length in patches) of one image (transformers'
        get_vision_window_index: windows of window_size pixels, row-major, each window's units row-major)."""
        unit, m = self.v["window_size"] // self.merge // self.patch, self.merge
        index = torch.arange(rows // m * (cols // m)).view(rows // m, cols // m)
        order, lengths = [], []
        for top in range(0, rows // m, unit):
            for left in range(0, cols // m, unit):
                window = index[top:top + unit, left:left + unit].reshape(-1)
                order.append(window)
                lengths.append(window.numel() * m * m)
        return torch.cat(order), lengths

    def forward(self, images) -> list[torch.Tensor]:
        dtype, device = self.patch_embed.proj.weight.dtype, self.patch_embed.proj.weight.device
        unit = self.merge ** 2
        pieces, cos, sin, orders, full, windowed, sizes = [], [], [], [], [0], [0], []
        for image in images:
            rows, cols = image.height // self.patch, image.width // self.patch
            patches, (c, s) = self.patches(image, device), self.rotary(rows, cols, device)
            if self.windowed:  # the patches window by window (whole merge units move)
                order, lengths = self.windows(rows, cols)
                order = order.to(device)
                orders.append(order + sum(sizes))
                moved = (order[:, None] * unit + torch.arange(unit, device=device)).reshape(-1)
                patches, c, s = patches[moved], c[moved], s[moved]
                for length in lengths:
                    windowed.append(windowed[-1] + length)
            pieces.append(patches)
            cos.append(c)
            sin.append(s)
            full.append(full[-1] + rows * cols)
            sizes.append(rows * cols // unit)
        weight = self.patch_embed.proj.weight
        flat = torch.cat(pieces).to(dtype)  # each patch's frame, temporal_patch_size times: the weights summed
        x = F.linear(flat.reshape(flat.shape[0], -1), weight.sum(dim=2).reshape(weight.shape[0], -1))
        cos, sin = torch.cat(cos), torch.cat(sin)
        full, windowed = segments(full, device), segments(windowed, device) if self.windowed else None
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, full if i in self.full_blocks else windowed)
        merged = self.merger(x)
        if self.windowed:
            merged = merged[torch.argsort(torch.cat(orders))]
        return list(merged.split(sizes))

    def map_name(self, name: str) -> tuple[str, int] | None:
        """`visual.<checkpoint name>` -> (our parameter name, 0); None for the rotary's buffers."""
        return None if "rotary_pos_emb" in name else (name, 0)
