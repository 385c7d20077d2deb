"""`pagedserve plan --memory`: the KV-cache arithmetic for a model and a context length.

How many requests of --context-len tokens fit at once in pools of the given sizes, and what the
block size costs: a request holds ceil(tokens / block_size) blocks, so its last block is partly
empty (block_size - 1 tokens wasted at worst, about half a block on average over lengths). The
model's bytes per token are its K and V planes, all layers, one rank (as the worker's KVCache
lays them out; MLA models keep one latent plane). No torch: the model's config.json and the dtype
are enough.
"""

from __future__ import annotations

from pagedserve.common.sizes import parse_size

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
POOL_SIZES = ("512MiB", "1GiB", "2GiB", "4GiB", "8GiB", "16GiB", "40GiB", "80GiB")
BLOCK_SIZES = (8, 16, 32, 64, 128)


def kv_bytes_per_token(model_folder, dtype: str, tensor_parallel_size: int = 1) -> int:
    from pagedserve.common.model_config import ModelConfig

    cfg = ModelConfig.from_folder(model_folder)
    layout = cfg.kv_layout(tensor_parallel_size)
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"--dtype for --memory must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    return layout.num_planes * cfg.num_hidden_layers * layout.num_heads * layout.head_dim * DTYPE_BYTES[dtype]


def memory_table(per_token: int, context_len: int, block_size: int, pools: list[int]) -> dict:
    blocks_per_request = -(-context_len // block_size)
    per_request = blocks_per_request * block_size * per_token
    rows = [{"kv_cache_bytes": pool, "num_blocks": pool // (block_size * per_token),
             "concurrent_requests": (pool // (block_size * per_token)) // blocks_per_request} for pool in pools]
    waste = []
    for bs in BLOCK_SIZES:
        blocks = -(-context_len // bs)
        waste.append({"block_size": bs, "wasted_tokens_at_this_length": blocks * bs - context_len,
                      "mean_wasted_tokens_over_lengths": (bs - 1) / 2,
                      "mean_wasted_bytes_per_request": (bs - 1) / 2 * per_token,
                      "waste_share_at_this_length": (blocks * bs - context_len) / (blocks * bs)})
    return {"kv_bytes_per_token": per_token, "context_len": context_len, "block_size": block_size,
            "bytes_per_request": per_request, "pools": rows, "block_size_waste": waste}


def print_memory(table: dict) -> None:
    mib = 2**20
    print(f"KV cache: {table['kv_bytes_per_token'] / 1024:.1f} KiB per token; a request of {table['context_len']} "
          f"tokens holds {table['bytes_per_request'] / mib:.1f} MiB in blocks of {table['block_size']}")
    print(f"{'KV pool':>10}{'blocks':>12}{'requests that fit':>20}")
    for row in table["pools"]:
        print(f"{row['kv_cache_bytes'] / 2**30:>9.2f}G{row['num_blocks']:>12}{row['concurrent_requests']:>20}")
    print(f"{'block size':>10}{'waste here':>12}{'mean waste':>12}{'mean waste MiB/req':>20}")
    for row in table["block_size_waste"]:
        print(f"{row['block_size']:>10}{row['wasted_tokens_at_this_length']:>12}"
              f"{row['mean_wasted_tokens_over_lengths']:>12.1f}{row['mean_wasted_bytes_per_request'] / mib:>20.3f}")


def run_memory(args) -> dict:
    import json
    from pathlib import Path

    if args.profile:
        from pagedserve.planner.cost_model import Profile
        per_token = Profile.load(args.profile).kv_bytes_per_token
    else:
        from pagedserve.model_files.default_model import resolve_model
        dtype = "bfloat16" if args.dtype == "auto" else args.dtype
        per_token = kv_bytes_per_token(resolve_model(args.model), dtype, args.tensor_parallel_size)
    if args.context_len is None or args.context_len < 1:
        raise ValueError("--memory needs --context-len N (tokens of prompt + output per request)")
    pools = [parse_size(args.kv_cache_memory)] if args.kv_cache_memory else [parse_size(p) for p in POOL_SIZES]
    table = memory_table(per_token, args.context_len, args.block_size, pools)
    print_memory(table)
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=2))
    return table
