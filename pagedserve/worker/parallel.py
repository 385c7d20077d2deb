"""Tensor parallelism (Megatron style): the sharded layers (the ranks' process group and its
collectives: process_group.py).

Every rank holds a slice of each big weight. A column-parallel linear keeps some output rows and
needs no communication; the row-parallel linear after it keeps the matching input columns and
sums its partial outputs with one all_reduce. So an attention block (QKV column, O row) or an
MLP (gate/up column, down row) costs one all_reduce each. Heads are split across ranks; when
there are fewer KV heads than ranks, each rank keeps the one KV head its query heads use.

Each layer loads its own shard from the full checkpoint tensor through `weight_loader`, reading
only the rows or columns it keeps (see weights.LazyWeight).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.worker.cpu_linear import packed_linear
from pagedserve.worker.embedding_table import EmbeddingTable
from pagedserve.worker.process_group import TPGroup, all_gather_last_dim, all_reduce, tp_group
from pagedserve.worker.quantized import DEQUANTIZE_ABOVE, QuantizedTensor


@dataclass(frozen=True, slots=True)
class Shard:
    """The rows [start, start + size) of one checkpoint tensor that this rank keeps."""
    start: int
    size: int


def even_shard(full_size: int, tp: TPGroup | None = None) -> Shard:
    tp = tp or tp_group()
    if full_size % tp.world_size:
        raise ValueError(f"a dimension of {full_size} does not split evenly across "
                         f"--tensor-parallel-size {tp.world_size}")
    size = full_size // tp.world_size
    return Shard(tp.rank * size, size)


def head_shards(num_heads: int, num_kv_heads: int, head_dim: int, tp: TPGroup | None = None) -> tuple[Shard, Shard]:
    """(query rows, kv rows) this rank keeps. KV heads are replicated when there are fewer than
    ranks: rank r keeps the KV head that its query heads are grouped with."""
    tp = tp or tp_group()
    if num_heads % tp.world_size:
        raise ValueError(f"{num_heads} attention heads do not split across --tensor-parallel-size {tp.world_size}")
    if num_kv_heads >= tp.world_size and num_kv_heads % tp.world_size:
        raise ValueError(f"{num_kv_heads} KV heads do not split across --tensor-parallel-size {tp.world_size}")
    if num_kv_heads < tp.world_size and tp.world_size % num_kv_heads:
        raise ValueError(f"--tensor-parallel-size {tp.world_size} is not a multiple of the {num_kv_heads} KV heads")
    local_heads = num_heads // tp.world_size
    local_kv = max(1, num_kv_heads // tp.world_size)
    kv_index = tp.rank * local_kv if num_kv_heads >= tp.world_size else tp.rank * num_kv_heads // tp.world_size
    return (Shard(tp.rank * local_heads * head_dim, local_heads * head_dim),
            Shard(kv_index * head_dim, local_kv * head_dim))


def new_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def mark_loader(param: nn.Parameter, loader, num_parts: int) -> None:
    param.weight_loader = loader
    param.num_parts = num_parts  # the loader must be called once per part before serving


class ColumnParallelLinear(nn.Module):
    """Several checkpoint projections merged into one matmul (q/k/v, or gate/up), each split by
    output rows. forward returns this rank's slice of every part, parts concatenated in order."""

    def __init__(self, in_features: int, shards: list[Shard], bias: bool = False) -> None:
        super().__init__()
        self.shards = shards
        self.offsets = [sum(s.size for s in shards[:i]) for i in range(len(shards))]
        self.output_sizes = [s.size for s in shards]
        self.weight = new_param(sum(self.output_sizes), in_features)
        mark_loader(self.weight, self._load, len(shards))
        self.packed = None  # cpu_linear.PackedWeight: the weight laid out for the CPU's kernels (pack_model)
        init_quantized(self)
        self.bias = None
        if bias:
            self.bias = new_param(sum(self.output_sizes))
            mark_loader(self.bias, self._load, len(shards))

    def _load(self, param: nn.Parameter, loaded, part: int) -> None:
        shard = self.shards[part]
        src = loaded.narrow(0, shard.start, shard.size)
        if isinstance(src, QuantizedTensor):
            check_shape((shard.size, param.shape[1]), src.shape)
            self.quant_parts[part] = src
            return
        copy_checked(param.data.narrow(0, self.offsets[part], shard.size), src)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.linear(x, self.bias)
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Split by input columns: each rank multiplies its slice of the input and the partial sums
    are added across ranks (the bias once, after the sum)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, reduce: bool = True) -> None:
        super().__init__()
        self.shard = even_shard(in_features)
        self.reduce = reduce  # False: the caller sums several partial outputs with one all_reduce
        self.weight = new_param(out_features, self.shard.size)
        mark_loader(self.weight, self._load, 1)
        self.packed = None
        init_quantized(self)
        self.bias = None
        if bias:
            self.bias = new_param(out_features)
            mark_loader(self.bias, lambda p, w, part: copy_checked(p.data, w.full()), 1)

    def _load(self, param: nn.Parameter, loaded, part: int) -> None:
        store_or_copy(self, param, loaded.narrow(1, self.shard.start, self.shard.size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            out = self.quant.linear(x)
        else:
            out = F.linear(x, self.weight) if self.packed is None else packed_linear(x, self.packed)
        if self.reduce:
            all_reduce(out)
        return out if self.bias is None else out + self.bias


class ReplicatedLinear(nn.Module):
    """Every rank holds the whole weight (small projections: routers, MLA's down projections)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = new_param(out_features, in_features)
        mark_loader(self.weight, lambda p, w, part: store_or_copy(self, p, w.full()), 1)
        self.packed = None
        init_quantized(self)
        self.bias = None
        if bias:
            self.bias = new_param(out_features)
            mark_loader(self.bias, load_full, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.linear(x, self.bias)
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


class VocabParallelEmbedding(EmbeddingTable):
    """Vocabulary rows split across ranks (padded to equal slices); a token's row comes from the
    rank that holds it, the others contribute zeros to the all_reduce. Also the LM head: each
    rank scores its vocabulary slice and the slices are gathered."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        tp = tp_group()
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // tp.world_size)
        self.start = tp.rank * self.rows_per_rank
        self.num_rows = max(0, min(vocab_size, self.start + self.rows_per_rank) - self.start)
        self.weight = new_param(self.rows_per_rank, hidden_size)
        mark_loader(self.weight, self._load, 1)
        self.packed = None  # for `logits`; the embedding lookup reads `weight`
        init_quantized(self)

    def _load(self, param: nn.Parameter, loaded, part: int) -> None:
        src = loaded.narrow(0, self.start, self.num_rows)
        if isinstance(src, QuantizedTensor):
            check_shape((self.num_rows, param.shape[1]), src.shape)
            self.quant_parts[0] = src.padded_rows(self.rows_per_rank)
            return
        param.data.zero_()
        copy_checked(param.data[:self.num_rows], src)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight) if self.quant is None else self.quant.rows(ids, self.weight.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_group().world_size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_rows)
        out = self._lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return all_reduce(out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 [rows, vocab_size] logits of hidden [rows, hidden_size]."""
        if self.quant is not None:  # float32 sums, unless many rows took the dequantized matmul
            local = self.quant.linear(hidden, dtype=torch.float32)
            if hidden.dtype != torch.float32 and hidden.shape[0] > DEQUANTIZE_ABOVE:
                refine_top_logits(local, hidden, rows_of=lambda ids: self.quant.rows(ids, torch.float32))
            return all_gather_last_dim(local)[:, :self.vocab_size]
        if self.packed is not None:
            local = packed_linear(hidden, self.packed)
        elif hidden.device.type == "cpu":
            # [vocab, hidden] @ [hidden, rows]: MKL streams the big weight once; F.linear's layout
            # ran 1.5-2x slower for decode batches on a 49k vocabulary.
            local = torch.mm(self.weight, hidden.t()).t().contiguous()
        else:
            local = F.linear(hidden, self.weight)
        if self.weight.dtype == torch.float32:
            local = local.float()
        else:
            local, top = float_with_top(local, REFINED_TOP)
            refine_top_logits(local, hidden, self.weight, top=top)
        return all_gather_last_dim(local)[:, :self.vocab_size]


# A bfloat16 matmul accumulates in float32 but rounds its output to 8 bits of mantissa: logits
# near 20 come out in steps of 0.125, so two candidates float32 tells apart by 0.2 can tie, and
# argmax then takes the lower token id (the default model in bfloat16 answered "Write a haiku
# about the sea." with <|im_end|> where float32 and transformers' bfloat16 answer "\n").
# Recomputing each row's few best in float32 restores their order at rows * k * hidden FLOPs.
REFINED_TOP = 8


def float_with_top(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits as float32, the indices of each row's k largest or None): on the CPU one pass of the
    compiled kernel (torch's copy and topk took ~3 ms of a batch-64 step, docs/performance.md)."""
    k = min(k, logits.shape[1])
    if logits.device.type == "cpu" and k > 0 and logits.shape[0] and logits.is_contiguous() \
            and logits.dtype in (torch.float32, torch.bfloat16):
        from pagedserve.kernels import cpu_ops
        ops = cpu_ops.load()
        if ops is not None:
            return ops.logits_top(logits, k)
    return logits.float(), None


def _top_indices(logits: torch.Tensor, k: int) -> torch.Tensor:
    """logits.topk(k, dim=1, sorted=False).indices; on the CPU in float32 one compiled pass a row (torch's
    took ~2 ms of a batch-50 step over a 49k vocabulary)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        from pagedserve.kernels import cpu_ops
        ops = cpu_ops.load()
        if ops is not None:
            return ops.top_indices(logits, k)
    return logits.topk(k, dim=1, sorted=False).indices


def refine_top_logits(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor | None = None,
                      rows_of=None, top: torch.Tensor | None = None) -> None:
    """Overwrite the REFINED_TOP largest logits of each row with their float32 dot products.
    logits [rows, n] float32 (computed in weight's dtype); hidden [rows, h]; weight [n, h], or
    rows_of(ids [rows, k]) -> those weight rows in float32 [rows, k, h] (a quantized weight);
    top: those largest' indices when the caller has them (float_with_top)."""
    k = min(REFINED_TOP, logits.shape[1])
    if k == 0 or logits.shape[0] == 0:
        return
    if top is None:
        top = _top_indices(logits, k)
    rows = weight[top].float() if rows_of is None else rows_of(top)
    exact = torch.bmm(rows, hidden.float().unsqueeze(2)).squeeze(2)
    logits.scatter_(1, top, exact)


def init_quantized(layer: nn.Module) -> None:
    layer.lora = None  # a lora.LoraLayer (worker/lora): the ops bundle adds its deltas (--enable-lora only)
    layer.quant = None  # a quantized.QuantizedWeight: forward runs the quantized kernel on it
    layer.quant_parts = {}  # part -> QuantizedTensor as loaded, until quantized.finalize


def store_or_copy(layer: nn.Module, param: nn.Parameter, src) -> None:
    """A one-part weight: quantized blocks are kept for quantized.finalize, float ones copied."""
    if isinstance(src, QuantizedTensor):
        check_shape(tuple(param.shape), src.shape)
        layer.quant_parts[0] = src
    else:
        copy_checked(param.data, src)


def check_shape(expected: tuple, got: tuple) -> None:
    if tuple(expected) != tuple(got):
        raise ValueError(f"checkpoint tensor of shape {tuple(got)} does not fit a parameter shard "
                         f"of shape {tuple(expected)}")


def copy_checked(dest: torch.Tensor, src: torch.Tensor | QuantizedTensor) -> None:
    if tuple(dest.shape) != tuple(src.shape):
        raise ValueError(f"checkpoint tensor of shape {tuple(src.shape)} does not fit a parameter shard "
                         f"of shape {tuple(dest.shape)}")
    if isinstance(src, QuantizedTensor):  # kept blocks where a float parameter takes them (MoE experts): dequantized
        from pagedserve.kernels import cpu_ops
        src = src.dequantize(cpu_ops.load(), dest.dtype)
    dest.copy_(src)


def load_full(param: nn.Parameter, loaded, part: int = 0) -> None:
    copy_checked(param.data, loaded.full())


def load_model_weights(model: nn.Module, weights, map_name) -> None:
    """Fill every parameter from HF-named checkpoint tensors. `map_name(hf_name)` returns
    (parameter name, part) or None to skip; each parameter's `weight_loader` takes its part and
    every part must arrive exactly once, so a missing or doubled tensor fails loudly."""
    params = dict(model.named_parameters())
    filled: dict[str, set] = {}
    for name, loaded in weights:
        target = map_name(name)
        if target is None:
            continue
        param_name, part = target
        param = params.get(param_name)
        if param is None:
            raise ValueError(f"unexpected weight {name!r} in the checkpoint (no parameter {param_name!r})")
        parts = filled.setdefault(param_name, set())
        if part in parts:
            raise ValueError(f"the checkpoint holds {name!r} twice")
        try:
            getattr(param, "weight_loader", load_full)(param, loaded, part)
        except ValueError as exc:
            raise ValueError(f"weight {name!r}: {exc}") from None
        parts.add(part)
    missing = [n for n, p in params.items() if len(filled.get(n, ())) < getattr(p, "num_parts", 1)]
    if missing:
        raise ValueError(f"the checkpoint lacks weights for {len(missing)} parameters, e.g. {sorted(missing)[:3]}")
