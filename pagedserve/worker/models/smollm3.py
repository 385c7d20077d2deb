"""SmolLM3 (HF's): the Llama skeleton with NoPE layers: a layer that `no_rope_layers` marks 0 (every
fourth by default, `no_rope_layer_interval`) gives its queries and keys no rotary, as transformers'
SmolLM3Attention does. Its sliding-window variant (`use_sliding_window`) is refused by ModelConfig.
"""

from __future__ import annotations

from torch import nn

from pagedserve.worker.attention import AttentionBackend
from pagedserve.worker.models.llama import LlamaForCausalLM


def rope_layers(hf: dict) -> list[bool]:
    """Whether each layer takes rotary (config.json's no_rope_layers, else every interval-th layer none)."""
    n = hf["num_hidden_layers"]
    given = hf.get("no_rope_layers")
    if given is not None:
        return [bool(x) for x in given]
    interval = hf.get("no_rope_layer_interval") or 4
    return [(i + 1) % interval != 0 for i in range(n)]


class SmolLM3ForCausalLM(LlamaForCausalLM):
    def make_attention(self, layer_index: int, backend: AttentionBackend) -> nn.Module:
        attention = super().make_attention(layer_index, backend)
        attention.use_rope = rope_layers(self.cfg.hf)[layer_index]
        return attention
