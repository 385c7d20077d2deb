"""Pixtral's vision tower (transformers' PixtralVisionModel) and Mistral3's multimodal projector, in plain
torch, over images at their own size (common/pixtral_config.py).

An ImageInput (RGB uint8, sides multiples of patch_size * merge_size) is normalized (rescale, mean, std),
through the patch convolution (no bias) into height/patch x width/patch patches, row-major, then ln_pre
(RMSNorm, eps 1e-5). Blocks: RMSNorm, attention without biases under 2D rotary, RMSNorm, SwiGLU
(down(act(gate) * up)). The rotary is transformers' axial layout: frequencies base^(-2i/head_dim), the even
ones turned by the patch's row, the odd ones by its column, [row freqs, column freqs] twice over the head.
Hidden state 0 is ln_pre's output, i the output of block i; the model's vision_feature_layer picks (and
concatenates) them, and only blocks up to the deepest picked are built and loaded.

Several images go through in one pass, each attending to itself only (block-diagonal, as transformers' mask:
vision/qwen2_vl.py's segments). Mistral3's projector: RMSNorm (the text model's eps), the patch merger
(each merge_size x merge_size window's patches, channel-major as torch's unfold lays them, one linear
without bias), linear_1, the activation, linear_2. Every tensor-parallel rank holds the whole tower and
encodes the same images; weights stay float in the serving dtype. Load time and the step thread only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.worker.vision.clip import Linear, _param, activation
from pagedserve.worker.vision.qwen2_vl import RMSNorm, _rotate_half, segment_attention, segments


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (p(x).view(n, self.num_heads, self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = (t * cos + _rotate_half(t) * sin for t in (q, k))  # cos, sin in x's dtype, as transformers
        return self.o_proj(segment_attention(q, k, v, groups, self.head_dim ** -0.5).reshape(n, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = Linear(dim, hidden, bias=False), Linear(dim, hidden, bias=False)
        self.down_proj, self.act = Linear(hidden, dim, bias=False), activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, v: dict) -> None:
        super().__init__()
        dim = v["hidden_size"]
        self.attention_norm, self.ffn_norm = RMSNorm(dim, 1e-5), RMSNorm(dim, 1e-5)
        self.attention = Attention(dim, v["num_attention_heads"])
        self.feed_forward = FeedForward(dim, v["intermediate_size"], v["hidden_act"])

    def forward(self, x, cos, sin, groups):
        x = x + self.attention(self.attention_norm(x), cos, sin, groups)
        return x + self.feed_forward(self.ffn_norm(x))


class PixtralVisionTower(nn.Module):
    """ImageInputs -> each one's selected hidden states [(height / patch) * (width / patch), hidden x layers],
    row-major. Parameter names are the checkpoint's under `vision_tower.`."""

    def __init__(self, vision: dict) -> None:
        super().__init__()
        self.v = v = vision
        self.patch = v["patch_size"]
        self.feature_layers = list(v["feature_layers"])
        self.patch_conv = nn.Module()
        self.patch_conv.weight = _param(v["hidden_size"], v["num_channels"], self.patch, self.patch)
        self.ln_pre = RMSNorm(v["hidden_size"], 1e-5)
        self.transformer = nn.Module()
        self.transformer.layers = nn.ModuleList(Layer(v) for _ in range(max(self.feature_layers)))
        head_dim = v["hidden_size"] // v["num_attention_heads"]
        freqs = 1.0 / v["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("row_freqs", freqs[0::2].clone(), persistent=False)  # turned by the patch's row
        self.register_buffer("col_freqs", freqs[1::2].clone(), persistent=False)  # and by its column

    def pixels(self, image, device: torch.device) -> torch.Tensor:
        """[3, height, width] float32, rescaled and normalized."""
        v = self.v
        raw = torch.frombuffer(bytearray(image.data), dtype=torch.uint8).view(image.height, image.width, 3)
        mean = torch.tensor(v["image_mean"], dtype=torch.float32, device=device)
        std = torch.tensor(v["image_std"], dtype=torch.float32, device=device)
        return ((raw.to(device).float() * v["rescale_factor"] - mean) / std).permute(2, 0, 1)

    def rotary(self, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        """The angles [rows * cols, head_dim] of an image's patches, row-major."""
        hpos = torch.arange(rows, device=device).repeat_interleave(cols).float()
        wpos = torch.arange(cols, device=device).repeat(rows).float()
        half = torch.cat([hpos[:, None] * self.row_freqs, wpos[:, None] * self.col_freqs], dim=-1)
        return torch.cat([half, half], dim=-1)

    def forward(self, images) -> list[torch.Tensor]:
        weight = self.patch_conv.weight
        dtype, device = weight.dtype, weight.device
        pieces, angles, bounds = [], [], [0]
        for image in images:
            rows, cols = image.height // self.patch, image.width // self.patch
            conv = F.conv2d(self.pixels(image, device)[None].to(dtype), weight, stride=self.patch)
            pieces.append(conv[0].flatten(1).t())
            angles.append(self.rotary(rows, cols, device))
            bounds.append(bounds[-1] + rows * cols)
        x = self.ln_pre(torch.cat(pieces))
        angles = torch.cat(angles)[:, None]
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        groups = segments(bounds, device)
        states = [x]
        for layer in self.transformer.layers:
            states.append(layer(states[-1], cos, sin, groups))
        picked = [states[i] for i in self.feature_layers]
        out = picked[0] if len(picked) == 1 else torch.cat(picked, dim=-1)
        return list(out.split([b - a for a, b in zip(bounds[:-1], bounds[1:])]))

    def map_name(self, name: str) -> tuple[str, int] | None:
        """`vision_tower.<checkpoint name>` -> (our parameter name, 0); None for blocks past the deepest picked
        and the rotary's buffers."""
        rest = name[len("vision_tower."):]
        if "patch_positional_embedding" in rest:
            return None
        if rest.startswith("transformer.layers.") and int(rest.split(".")[2]) >= len(self.transformer.layers):
            return None
        return name, 0


class Mistral3Projector(nn.Module):
    """Mistral3MultiModalProjector: one image's features [rows * cols, hidden] (rows x cols patches, row-major)
    -> its rows [(rows / merge) * (cols / merge), text hidden]."""

    def __init__(self, vision: dict, text_hidden: int) -> None:
        super().__init__()
        hidden, self.merge = vision["hidden_size"], vision["merge_size"]
        bias = vision["projector_bias"]
        self.norm = RMSNorm(hidden, vision["projector_norm_eps"])
        self.patch_merger = nn.Module()
        self.patch_merger.merging_layer = Linear(hidden * self.merge ** 2, hidden, bias=False)
        self.linear_1 = Linear(hidden, text_hidden, bias)
        self.linear_2 = Linear(text_hidden, text_hidden, bias)
        self.act = activation(vision["projector_hidden_act"])

    def forward(self, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        m, d = self.merge, x.shape[-1]
        x = self.norm(x).view(rows // m, m, cols // m, m, d).permute(0, 2, 4, 1, 3).reshape(-1, d * m * m)
        return self.linear_2(self.act(self.linear_1(self.patch_merger.merging_layer(x))))
