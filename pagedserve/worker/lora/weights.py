"""A PEFT adapter's tensors laid out for this model and this tensor-parallel rank.

Each PEFT module (`model.layers.0.self_attn.q_proj`) is mapped by the model's own checkpoint
naming (`map_name`, the one rule that merges q/k/v and gate/up) to our layer and its part, then
cut to this rank's shard as the layer cuts its weight: a column-parallel part keeps its output
rows of B, a row-parallel layer its input columns of A. B is scaled once here (lora_alpha / r, or
rslora's / sqrt(r)).
"""

from __future__ import annotations

import torch
from safetensors import safe_open
from torch import nn

from pagedserve.common.lora import PEFT_PREFIX, AdapterSpec, LoraError
from pagedserve.worker import parallel, process_group

# layer name -> part -> (A [r, in_shard], scaled B [out_shard, r])
AdapterWeights = dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]


def lora_targets(model: nn.Module) -> dict[str, list[tuple[int, int]]]:
    """The layers an adapter may adapt: every linear layer that a target projection maps to, as
    layer name -> its parts' (offset, size) in its output."""
    out = {}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "q_proj", "k_proj", "v_proj"):
            continue
        if isinstance(module, parallel.ColumnParallelLinear):
            out[name] = list(zip(module.offsets, module.output_sizes))
        elif isinstance(module, (parallel.RowParallelLinear, parallel.ReplicatedLinear)):
            out[name] = [(0, out_features(module))]
    return out


def out_features(layer: nn.Module) -> int:
    """A linear layer's output size on this rank (a quantized layer's float weight is empty)."""
    return layer.weight.shape[0] if layer.quant is None else sum(layer.quant.row_counts)


def lora_macs_per_rank(model: nn.Module) -> int:
    """An adapted row's extra multiply-adds per unit of rank (the planner's LoRA term): every
    target layer's shrink (each part's A over the layer's input) and expand (its output)."""
    total = 0
    for name, parts in lora_targets(model).items():
        layer = model.get_submodule(name)
        total += len(parts) * layer.weight.shape[1] + sum(size for _, size in parts)
    return total


def linear_macs_per_token(model: nn.Module) -> int:
    """Multiply-adds of one token through the model's linear layers (this rank; the LM head and
    embeddings are not linear layers here)."""
    return sum(m.weight.shape[1] * out_features(m) for m in model.modules()
               if isinstance(m, (parallel.ColumnParallelLinear, parallel.RowParallelLinear,
                                 parallel.ReplicatedLinear)))


def load_adapter(model: nn.Module, spec: AdapterSpec, dtype: torch.dtype) -> AdapterWeights:
    """spec's tensors for this model and rank, on the CPU in dtype. LoraError when a module has
    no layer here or its shapes do not fit the model."""
    targets = lora_targets(model)
    out: AdapterWeights = {}
    with safe_open(spec.weights_file, framework="pt") as f:
        keys = {k.removeprefix(PEFT_PREFIX).replace(".default.weight", ".weight"): k for k in f.keys()}
        for m in spec.modules:
            mapped = model.map_name(m.module + ".weight")
            layer_name = mapped[0].removesuffix(".weight") if mapped else None
            if layer_name not in targets:
                raise LoraError(f"LoRA adapter {spec.name!r}: module {m.module!r} has no adaptable layer in this "
                                "model")
            part = mapped[1]
            a = f.get_tensor(keys[f"{m.module}.lora_A.weight"]).to(torch.float32)
            b = f.get_tensor(keys[f"{m.module}.lora_B.weight"]).to(torch.float32) * m.scaling
            layer = model.get_submodule(layer_name)
            a, b = _shard(layer, part, a, b, spec.name, m.module)
            out.setdefault(layer_name, {})[part] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
    return out


def _shard(layer: nn.Module, part: int, a: torch.Tensor, b: torch.Tensor, name: str, module: str):
    """(A, B) cut to this rank's shard of layer's part, their shapes checked against the model's."""
    in_features, ranks = layer.weight.shape[1], process_group.tp_group().world_size
    if isinstance(layer, parallel.ColumnParallelLinear):
        shard = layer.shards[part]
        fits, ok = (f"?x{in_features}", b.shape[0] >= shard.start + shard.size and a.shape[1] == in_features)
        if ok:
            return a, b.narrow(0, shard.start, shard.size)
    elif isinstance(layer, parallel.RowParallelLinear):
        shard = layer.shard
        fits = f"{out_features(layer)}x{in_features * ranks}"
        if a.shape[1] == in_features * ranks and b.shape[0] == out_features(layer):
            return a.narrow(1, shard.start, shard.size), b
    else:
        fits = f"{out_features(layer)}x{in_features}"
        if (b.shape[0], a.shape[1]) == (out_features(layer), in_features):
            return a, b
    raise LoraError(f"LoRA adapter {name!r}: {module!r} is {b.shape[0]}x{a.shape[1]}, which does not fit the "
                    f"model's {fits}")
