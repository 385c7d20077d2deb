"""CLIP's vision tower (transformers' CLIPVisionModel, the parts LLaVA reads: the hidden states of
its encoder layers), LLaVA's projector, and an image's normalization, in plain torch.

Numerics follow transformers: a patch convolution without bias, the class embedding ahead of the
patches, learned position embeddings, pre_layrnorm, then pre-norm encoder layers (attention with
q/k/v/out biases scaled by head_dim ** -0.5, no mask; fc1, the activation, fc2). Only the layers up to
the deepest one LLaVA selects are built and loaded (post_layernorm and later layers never are).

Every tensor-parallel rank holds the whole tower and projector (they are small next to the text
model) and encodes the same images itself: the ranks' rows agree without a broadcast. Weights stay
float in the serving dtype whatever --quantization says (their layers are not the parallel linears the
quantized and packed paths look for). Load time and the model runner's step thread only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {"quick_gelu": _quick_gelu, "gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "relu": F.relu}


def activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r} in the vision tower; "
                         f"have {', '.join(ACTIVATIONS)}") from None


class Linear(nn.Module):
    """A plain (replicated) linear layer: weight [out, in], optional bias."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class LayerNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight, self.bias, self.eps = _param(size), _param(size), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class Embeddings(nn.Module):
    def __init__(self, v: dict) -> None:
        super().__init__()
        hidden, patch = v["hidden_size"], v["patch_size"]
        self.patch_size = patch
        self.class_embedding = _param(hidden)
        self.patch_embedding = nn.Module()
        self.patch_embedding.weight = _param(hidden, v["num_channels"], patch, patch)
        self.position_embedding = nn.Module()
        self.position_embedding.weight = _param((v["image_size"] // patch) ** 2 + 1, hidden)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = F.conv2d(pixels, self.patch_embedding.weight, stride=self.patch_size).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(pixels.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class Attention(nn.Module):
    def __init__(self, v: dict) -> None:
        super().__init__()
        hidden = v["hidden_size"]
        self.num_heads = v["num_attention_heads"]
        self.head_dim = hidden // self.num_heads
        self.scale = self.head_dim ** -0.5
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (Linear(hidden, hidden) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, scale=self.scale)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, v: dict) -> None:
        super().__init__()
        self.fc1 = Linear(v["hidden_size"], v["intermediate_size"])
        self.fc2 = Linear(v["intermediate_size"], v["hidden_size"])
        self.act = activation(v["hidden_act"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, v: dict) -> None:
        super().__init__()
        self.self_attn, self.mlp = Attention(v), MLP(v)
        self.layer_norm1 = LayerNorm(v["hidden_size"], v["layer_norm_eps"])
        self.layer_norm2 = LayerNorm(v["hidden_size"], v["layer_norm_eps"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPVisionTower(nn.Module):
    """pixels [images, channels, size, size] -> the selected hidden states [images, rows, hidden x layers]
    (vision: ModelConfig.vision). Parameter names are the checkpoint's under `vision_tower.`, less the
    `vision_model.` that the hub's files have there and transformers 5's do not."""

    def __init__(self, vision: dict) -> None:
        super().__init__()
        self.feature_layers = list(vision["feature_layers"])
        self.drop_cls = vision["select_strategy"] == "default"
        self.embeddings = Embeddings(vision)
        self.pre_layrnorm = LayerNorm(vision["hidden_size"], vision["layer_norm_eps"])
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(EncoderLayer(vision) for _ in range(max(self.feature_layers)))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        hidden = self.pre_layrnorm(self.embeddings(pixels.to(self.pre_layrnorm.weight.dtype)))
        states = [hidden]
        for layer in self.encoder.layers:
            states.append(layer(states[-1]))
        picked = [states[i][:, 1:] if self.drop_cls else states[i] for i in self.feature_layers]
        return picked[0] if len(picked) == 1 else torch.cat(picked, dim=-1)

    def map_name(self, name: str) -> tuple[str, int] | None:
        """`vision_tower.<checkpoint name>` -> (our parameter name, 0), None for what the tower leaves out."""
        rest = name[len("vision_tower."):]
        rest = rest[len("vision_model."):] if rest.startswith("vision_model.") else rest
        if rest.startswith(("post_layernorm.", "head.")) or "position_ids" in rest:
            return None
        if rest.startswith("encoder.layers.") and int(rest.split(".")[2]) >= len(self.encoder.layers):
            return None
        return "vision_tower." + rest, 0


class Projector(nn.Module):
    """LLaVA's multi_modal_projector: linear_1, the activation, linear_2."""

    def __init__(self, vision: dict, text_hidden: int) -> None:
        super().__init__()
        bias = vision["projector_bias"]
        self.linear_1 = Linear(vision["hidden_size"] * len(vision["feature_layers"]), text_hidden, bias)
        self.linear_2 = Linear(text_hidden, text_hidden, bias)
        self.act = activation(vision["projector_hidden_act"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def normalized_pixels(images, vision: dict, device: torch.device) -> torch.Tensor:
    """ImageInputs' RGB uint8 bytes -> float32 pixels [images, 3, height, width]: times rescale_factor,
    then (x - image_mean) / image_std per channel (ModelConfig.vision's, from preprocessor_config.json)."""
    size = vision["image_size"]
    for image in images:
        if image.height != size or image.width != size:
            raise ValueError(f"an image of {image.height}x{image.width}: this model's vision tower takes "
                             f"{size}x{size} (the front end resizes and crops)")
    raw = torch.frombuffer(bytearray(b"".join(image.data for image in images)), dtype=torch.uint8)
    pixels = raw.view(len(images), size, size, 3).to(device).permute(0, 3, 1, 2).float()
    mean = torch.tensor(vision["image_mean"], dtype=torch.float32, device=device).view(1, 3, 1, 1)
    std = torch.tensor(vision["image_std"], dtype=torch.float32, device=device).view(1, 3, 1, 1)
    return (pixels * vision["rescale_factor"] - mean) / std

