"""`pagedserve bench quality`: how much a dtype or a quantization loses, measured as llama.cpp's
llama-perplexity measures it.

The text (--text, or the bundled sample: this project's own prose and code, ~5,400 tokens with the default
model's tokenizer) is tokenized once and cut into windows of --ctx tokens; each window runs teacher-forced
as one prefill (several windows per forward pass) through the serving model runner's model, its KV cache
and attention backends, and only the second half of each window is scored (every scored token sees at
least ctx/2 tokens of context), as llama-perplexity does. A tokenizer that starts its encodings with a BOS token
(leading_bos) gets it as each window's first token.

Against a reference run of the same windows (--reference-dtype float32 --reference-quantization none by
default) it reports, over the scored tokens: perplexity (exp of the mean negative log-likelihood) of both,
the mean and 99th percentile of KL(reference || tested), how often the two agree on the most likely token,
and the largest difference of any logit. --json FILE writes perplexity, kl_mean, kl_p99, top1_agreement,
max_logit_diff (and the reference's perplexity). --llama-perplexity PATH also runs llama.cpp's
llama-perplexity on the same GGUF, text and window, and prints its perplexity in the same table.

Runs in process (tensor parallel size 1). Models whose KV groups differ per layer (Gemma 3's sliding and
global layers) run as they are served: each window holds its own blocks in every group, and each layer
reads its group's tables (the model runner's batch_metadata)."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

SAMPLE = "quality_sample.txt"
KEYS = ("perplexity", "kl_mean", "kl_p99", "top1_agreement", "max_logit_diff")


def sample_text() -> str:
    return resources.files("pagedserve.bench").joinpath("data", SAMPLE).read_text(encoding="utf-8")


def windows_of(ids: list[int], ctx: int, bos: int | None) -> list[list[int]]:
    """Consecutive whole windows of ctx tokens (the tail shorter than ctx is dropped, as llama-perplexity
    drops it); with a BOS id each window starts with it in place of its first token."""
    if ctx < 4:
        raise ValueError(f"--ctx must be at least 4, got {ctx}")
    wins = [ids[i:i + ctx] for i in range(0, len(ids) - ctx + 1, ctx)]
    if not wins:
        raise ValueError(f"the text has {len(ids)} tokens: fewer than one window of --ctx {ctx}")
    return [[bos, *w[1:]] if bos is not None else w for w in wins]


def leading_bos(tokenizer) -> int | None:
    """The BOS id if the tokenizer starts an encoding with it (as llama.cpp's tokenizer then does),
    else None. Asked of an encoding, not of add_bos_token: Gemma's tokenizer adds it by its
    post-processor with add_bos_token False (Gemma 3 270M without its BOS: perplexity 40 on the
    sample instead of 25)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("x", add_special_tokens=True)["input_ids"]
    return bos if ids and ids[0] == bos else None


def scored_range(ctx: int) -> tuple[int, int]:
    """Positions whose logits are scored (each against the next token): the window's second half."""
    return ctx // 2, ctx - 1


@dataclass
class Scores:
    """Running sums over the scored tokens."""
    nll: float = 0.0
    ref_nll: float = 0.0
    count: int = 0
    agree: int = 0
    max_logit_diff: float = 0.0

    def __post_init__(self) -> None:
        self.kls: list = []


@dataclass(slots=True)
class WindowState:
    """One window as the model runner's batch layout reads a request: nothing computed yet, and its
    own blocks in every KV group."""
    block_ids: list[int]
    group_block_ids: list[list[int]]
    num_computed_tokens: int = 0


def window_states(count: int, ctx: int, block_size: int, num_groups: int) -> list[WindowState]:
    """count windows' block tables: each window holds ctx tokens in every KV group, no block shared
    (a block id belongs to one group at a time, as the scheduler's block manager hands them out)."""
    per_window = -(-ctx // block_size)
    tables = [[list(range((i * num_groups + g) * per_window, (i * num_groups + g + 1) * per_window))
               for g in range(num_groups)] for i in range(count)]
    return [WindowState(t[0], t[1:]) for t in tables]


def window_logits(runner, windows: list[list[int]]):
    """Yield, per window, the float32 logits of its scored positions [ctx/2 .. ctx-2], computed by the
    runner's model over its KV cache, as many windows per forward pass as the cache's blocks hold. The
    batch's attention metadata is the runner's own (batch_metadata: with KV groups, Gemma 3's sliding
    and global layers each get their group's tables), as for a step of whole-prompt prefills."""
    import numpy as np
    import torch

    from pagedserve.worker.process_group import using_group

    ctx, num_groups = len(windows[0]), len(runner.kv.groups.layers)
    per_window = -(-ctx // runner.block_size) * num_groups
    if runner.kv.num_blocks < per_window:
        raise ValueError(f"the KV cache holds {runner.kv.num_blocks} blocks: one window of --ctx {ctx} needs "
                         f"{per_window}; raise --kv-cache-memory")
    batch = min(runner.kv.num_blocks // per_window, 8)
    first, last = scored_range(ctx)
    device = runner.device
    states = window_states(batch, ctx, runner.block_size, num_groups)
    for b0 in range(0, len(windows), batch):
        group = windows[b0:b0 + batch]
        ids = torch.tensor([t for w in group for t in w], dtype=torch.long, device=device)
        positions = np.tile(np.arange(ctx, dtype=np.int64), len(group))
        meta = runner.batch_metadata([], [(state, ctx) for state in states[:len(group)]], positions)
        with torch.inference_mode(), using_group(runner.tp):
            hidden = runner.model(ids, torch.from_numpy(positions).to(device), runner.kv.model_caches(), meta)
            for i in range(len(group)):
                yield runner.model.compute_logits(hidden[i * ctx + first:i * ctx + last]).float()


# Rows scored at a time: a row of Gemma 3's 262,144 logits is 1 MiB in float32, and scoring makes about
# five temporaries of each (all 255 rows of a 512-token window at once: ~1.3 GiB of them).
SCORE_ROWS = 32


def score(s: Scores, got, ref, targets) -> None:
    """Add rows of tested and reference logits (float32, [rows, vocab]) to the sums."""
    import torch

    logp, ref_logp = torch.log_softmax(got, -1), torch.log_softmax(ref, -1)
    s.nll -= logp.gather(1, targets[:, None]).sum().item()
    s.ref_nll -= ref_logp.gather(1, targets[:, None]).sum().item()
    s.kls.append((ref_logp.exp() * (ref_logp - logp)).sum(-1).clamp(min=0).cpu())
    s.agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
    s.max_logit_diff = max(s.max_logit_diff, (got - ref).abs().max().item())
    s.count += targets.numel()


def compare(tested_runner, reference_runner, windows: list[list[int]]) -> dict:
    """The metrics of KEYS (and reference_perplexity) over every window's scored tokens."""
    import torch

    first, last = scored_range(len(windows[0]))
    s = Scores()
    for w, got, ref in zip(windows, window_logits(tested_runner, windows), window_logits(reference_runner, windows)):
        targets = torch.tensor(w[first + 1:last + 1], device=got.device)
        ref = ref.to(got.device)
        for r in range(0, len(targets), SCORE_ROWS):
            score(s, got[r:r + SCORE_ROWS], ref[r:r + SCORE_ROWS], targets[r:r + SCORE_ROWS])
    kl = torch.cat(s.kls).double()
    return {"perplexity": math.exp(s.nll / s.count), "kl_mean": kl.mean().item(),
            "kl_p99": torch.quantile(kl, 0.99).item(), "top1_agreement": s.agree / s.count,
            "max_logit_diff": s.max_logit_diff, "reference_perplexity": math.exp(s.ref_nll / s.count),
            "scored_tokens": s.count, "windows": len(windows)}


# ---- llama.cpp -----------------------------------------------------------------------------------
def find_llama_perplexity(explicit: str | None) -> Path | None:
    from pagedserve.bench.llama_cpp import data_dir
    for c in (explicit, os.environ.get("PAGEDSERVE_LLAMA_PERPLEXITY"), data_dir() / "llama.cpp" / "llama-perplexity",
              shutil.which("llama-perplexity")):
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return Path(c)
    return None


def parse_llama_perplexity(text: str) -> float:
    """llama-perplexity's "Final estimate: PPL = 12.3456 +/- 0.12345" -> 12.3456."""
    match = re.search(r"Final estimate: PPL = ([0-9.]+)", text)
    if match is None:
        raise ValueError("no 'Final estimate: PPL = ...' line in llama-perplexity's output")
    return float(match.group(1))


def run_llama_perplexity(binary: Path, gguf: Path, text_file: Path, ctx: int, threads: int) -> float:
    libs = ":".join(p for p in (str(binary.parent), os.environ.get("LD_LIBRARY_PATH")) if p)
    # LLAMA_ARG_REPACK=0 (unless set): llama.cpp's AMX repacking crashed on the default Q4_1 file on a
    # Sapphire Rapids-class CPU (ggml_backend_amx_mul_mat); repacking changes speed, not the numbers
    env = {"LLAMA_ARG_REPACK": "0", **os.environ, "LD_LIBRARY_PATH": libs}
    proc = subprocess.run([str(binary), "-m", str(gguf), "-f", str(text_file), "-c", str(ctx), "-t", str(threads)],
                          capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode:
        raise RuntimeError(f"llama-perplexity exited {proc.returncode}: {proc.stderr[-2000:]}")
    return parse_llama_perplexity(proc.stdout + proc.stderr)


# ---- the command -----------------------------------------------------------------------------------
def build(args, model_path: Path, tokenizer, dtype: str, quantization: str):
    from pagedserve.bench.throughput import build_engine
    variant = argparse.Namespace(**{**vars(args), "dtype": dtype, "quantization": quantization,
                                    "kv_cache_memory": args.kv_cache_memory or "256MiB", "tensor_parallel_size": 1})
    return build_engine(variant, model_path, tokenizer)


def run_quality(args: argparse.Namespace) -> dict:
    from pagedserve.bench.throughput import load_tokenizer
    from pagedserve.model_files.default_model import resolve_model

    model_path = Path(resolve_model(args.model, args.revision))
    tokenizer = load_tokenizer(model_path)
    text = Path(args.text).read_text(encoding="utf-8") if args.text else sample_text()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = leading_bos(tokenizer)
    windows = windows_of(ids, args.ctx, bos)
    tested = build(args, model_path, tokenizer, args.dtype, args.quantization)
    reference = build(args, model_path, tokenizer, args.reference_dtype, args.reference_quantization)
    try:
        result = compare(tested.runner, reference.runner, windows)
    finally:
        tested.close()
        reference.close()
    result.update(dtype=str(tested.dtype).removeprefix("torch."), quantization=tested.runner.quantization,
                  reference=f"{args.reference_dtype}/{args.reference_quantization}", ctx=args.ctx)
    rows = [(f"pagedserve {result['dtype']} {result['quantization']}", result["perplexity"],
             f"{result['kl_mean']:.5f}", f"{result['kl_p99']:.5f}", f"{result['top1_agreement']:.4f}",
             f"{result['max_logit_diff']:.4f}"),
            (f"pagedserve reference {result['reference']}", result["reference_perplexity"], "0", "0", "1", "0")]
    if args.llama_perplexity is not None:
        binary = find_llama_perplexity(args.llama_perplexity or None)
        if binary is None:
            raise SystemExit("llama-perplexity not found: pass its path with --llama-perplexity PATH "
                             "(see `pagedserve bench llama-cpp --help` for building llama.cpp)")
        from pagedserve.bench.llama_cpp import find_gguf
        gguf, _ = find_gguf(str(model_path))
        text_file = Path(args.text) if args.text else Path(str(resources.files("pagedserve.bench") / "data" / SAMPLE))
        result["llama_cpp_perplexity"] = run_llama_perplexity(binary, gguf, text_file, args.ctx, os.cpu_count() or 1)
        rows.append((f"llama.cpp {gguf.name}", result["llama_cpp_perplexity"], "-", "-", "-", "-"))
    print(f"{len(windows)} windows of {args.ctx} tokens, {result['scored_tokens']} scored")
    print(f"{'run':<40} {'perplexity':>10} {'kl_mean':>9} {'kl_p99':>9} {'top1':>7} {'max_logit_diff':>15}")
    for name, ppl, *rest in rows:
        print(f"{name:<40} {ppl:>10.4f} {rest[0]:>9} {rest[1]:>9} {rest[2]:>7} {rest[3]:>15}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


def add_quality_parser(bench_sub) -> None:
    from pagedserve.common.engine_args import add_engine_args
    p = bench_sub.add_parser("quality", help="perplexity and KL divergence against a float32 reference",
                             description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", default=None, metavar="FILE", help="the text to score (default: the bundled sample)")
    p.add_argument("--ctx", type=int, default=512, help="window length in tokens (llama-perplexity's -c)")
    p.add_argument("--reference-dtype", default="float32")
    p.add_argument("--reference-quantization", default="none")
    p.add_argument("--llama-perplexity", nargs="?", const="", default=None, metavar="PATH",
                   help="also run llama.cpp's llama-perplexity (this binary, or the one `bench llama-cpp` uses)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON here")
    add_engine_args(p)
    p.set_defaults(func=run_quality)
