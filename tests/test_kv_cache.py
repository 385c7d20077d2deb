"""The worker's KV cache tensor and the per-layer views the model reads and writes through."""

from __future__ import annotations

import torch

from pagedserve.common.model_config import ModelConfig
from pagedserve.worker.kv_cache import KVCache

LLAMA = dict(architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
GEMMA3 = dict(architectures=["Gemma3ForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
              num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
              sliding_window=32, sliding_window_pattern=6)


def test_layer_views_are_the_cache_through_copies_and_swaps():
    kv = KVCache(ModelConfig.from_hf_dict(LLAMA), num_blocks=6, block_size=4, dtype=torch.float32,
                 device=torch.device("cpu"), num_host_blocks=2)
    views = kv.model_caches()
    assert kv.model_caches() is views and len(views) == 3 and all(len(planes) == 2 for planes in views)
    k, v = views[1]
    k[2].fill_(1.0)  # what a layer writes lands in the one tensor
    v[2].fill_(2.0)
    assert kv.device_cache[1, 0, 2].eq(1.0).all() and kv.device_cache[1, 1, 2].eq(2.0).all()
    kv.copy_blocks([(2, 5)])
    assert k[5].eq(1.0).all() and v[5].eq(2.0).all()  # a block copy is seen through the views
    kv.swap_out([(2, 0)])
    kv.device_cache.zero_()
    kv.swap_in([(0, 3)])
    assert k[3].eq(1.0).all() and v[3].eq(2.0).all() and k[2].eq(0.0).all()


def test_hybrid_groups_share_a_slot_per_layer_position():
    cfg = ModelConfig.from_hf_dict(GEMMA3)
    kv = KVCache(cfg, num_blocks=4, block_size=4, dtype=torch.float32, device=torch.device("cpu"))
    groups = cfg.kv_groups()
    assert groups.hybrid
    views = kv.model_caches()
    assert len(views) == 12
    slot_of = groups.slot_of()
    for layer in range(12):
        expected = kv.device_cache[slot_of[layer][1]]
        assert views[layer][0].data_ptr() == expected[0].data_ptr()
        assert views[layer][1].data_ptr() == expected[1].data_ptr()
