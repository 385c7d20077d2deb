"""The step-time cost model: how long one engine step takes, from what the scheduler put in it.

A step is described by its shape (StepShape): the prompt tokens it prefills, the sequences it
decodes, the rows it samples, and the attention work (prefill query x key pairs, decode context
tokens). Its time is a non-negative combination of those, piecewise-linear in the step's tokens
(a second slope past a knee, where the matmuls turn from weight-bound to compute-bound):

    t = fixed + per_token * T + per_token_past_knee * max(0, T - knee) + per_sample * S
        + per_prefill_pair * A_prefill + per_decode_context_token * A_decode

Every coefficient is a time (seconds per unit) and >= 0 (non-negative least squares), so the fit
reads as a bill: "this step cost 2 ms fixed, 0.3 ms per token, ...". calibrate.py measures the
samples; the planner's simulator prices each step it schedules with predict(). Plain Python and
numpy/scipy: no torch (the simulator imports this).

LoRA adapters (--enable-lora) add a term the base calibration prices from the model's arithmetic
(LoraCost): a row of an adapter costs its extra multiply-adds (the CPU kernel computes every
adapted layer's shrink and expand at --max-lora-rank: rank x sum over the target layers of
parts x in + out) at the calibrated seconds per base multiply-add, and each adapter in the step
(a slot) reads its stacks once, those bytes at the calibrated fixed step cost per base weight byte.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

TERMS = ("fixed", "per_token", "per_token_past_knee", "per_sample", "per_prefill_pair", "per_decode_context_token")
KNEE_CANDIDATES = (0, 16, 32, 64, 128, 256, 512)
PROFILE_VERSION = 1


@dataclass(slots=True)
class StepShape:
    prefill_tokens: int = 0  # tokens of requests scheduled for more than one token (prompt chunks)
    decode_seqs: int = 0  # requests scheduled for exactly one token (the runner's decode path)
    sampled: int = 0  # rows that reach the end of their tokens and are sampled (the LM head runs on them)
    prefill_pairs: float = 0.0  # causal attention pairs of the prefill chunks: sum n * (context + (n + 1) / 2)
    decode_context: int = 0  # tokens the decodes attend to: sum of their context lengths
    lora_rows: int = 0  # tokens of requests with a LoRA adapter
    lora_slots: int = 0  # distinct adapters in the step (each one's stacks are read once)

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_seqs

    def add(self, num_new: int, num_computed: int, num_total: int, lora: bool = False) -> None:
        """One request of the step: num_new tokens on num_computed already in its cache, of
        num_total known tokens (it is sampled when it reaches the end); lora: it has an adapter
        (the caller counts the step's distinct adapters in lora_slots)."""
        if lora:
            self.lora_rows += num_new
        if num_new == 1:
            self.decode_seqs += 1
            self.decode_context += num_computed + 1
        else:
            self.prefill_tokens += num_new
            self.prefill_pairs += num_new * (num_computed + (num_new + 1) / 2)
        if num_computed + num_new >= num_total:
            self.sampled += 1


def features(shape: StepShape, knee: int) -> list[float]:
    t = shape.tokens
    return [1.0, float(t), float(max(0, t - knee)) if knee else 0.0, float(shape.sampled),
            float(shape.prefill_pairs), float(shape.decode_context)]


@dataclass(slots=True)
class FitReport:
    points: int = 0
    mean_abs_rel_error: float = 0.0
    p90_abs_rel_error: float = 0.0
    max_abs_rel_error: float = 0.0

    def line(self) -> str:
        return (f"fit over {self.points} measured steps: mean |error| {100 * self.mean_abs_rel_error:.1f}%, "
                f"p90 {100 * self.p90_abs_rel_error:.1f}%, max {100 * self.max_abs_rel_error:.1f}%")


@dataclass(slots=True)
class CostModel:
    coefficients: dict[str, float]  # TERMS -> seconds per unit
    knee: int = 0
    fit: FitReport = field(default_factory=FitReport)

    def predict(self, shape: StepShape) -> float:
        """Seconds one step of this shape takes on the calibrated machine (0 for an empty step)."""
        if shape.tokens == 0:
            return 0.0
        return float(sum(self.coefficients[name] * x for name, x in zip(TERMS, features(shape, self.knee))))

    def explain(self) -> str:
        units = {"fixed": "ms per step", "per_token": "ms per token",
                 "per_token_past_knee": f"ms per token past {self.knee}", "per_sample": "ms per sampled row",
                 "per_prefill_pair": "ms per 1k prefill attention pairs", "per_decode_context_token":
                 "ms per 1k decode context tokens"}
        scale = {"per_prefill_pair": 1e6, "per_decode_context_token": 1e6}
        return "\n".join(f"  {name:<26}{self.coefficients[name] * scale.get(name, 1e3):>10.4f} {units[name]}"
                         for name in TERMS)


def fit(samples: list[tuple[StepShape, float]]) -> CostModel:
    """Non-negative least squares on relative error (each row divided by its measured time, so a
    1 ms step weighs as much as a 1 s one), trying each knee and keeping the best."""
    from scipy.optimize import nnls

    if len(samples) < len(TERMS):
        raise ValueError(f"the cost model needs at least {len(TERMS)} measured steps, got {len(samples)}")
    times = np.asarray([t for _, t in samples])
    best: CostModel | None = None
    for knee in KNEE_CANDIDATES:
        x = np.asarray([features(s, knee) for s, _ in samples])
        scale = x.max(axis=0)
        scale[scale == 0] = 1.0  # an unused term (no knee) stays zero
        coef, _ = nnls((x / scale) / times[:, None], np.ones(len(times)))
        coef = coef / scale
        report = fit_report(x @ coef, times)
        if best is None or report.mean_abs_rel_error < best.fit.mean_abs_rel_error:
            best = CostModel(dict(zip(TERMS, map(float, coef))), knee, report)
    return best


def fit_report(predicted: np.ndarray, measured: np.ndarray) -> FitReport:
    rel = np.abs(predicted - measured) / measured
    return FitReport(len(measured), float(rel.mean()), float(np.percentile(rel, 90)), float(rel.max()))


@dataclass(slots=True, frozen=True)
class LoraCost:
    """The adapters' extra seconds in a step: per adapted row and per adapter in the step."""
    seconds_per_row: float = 0.0
    seconds_per_slot: float = 0.0

    def seconds(self, shape: StepShape) -> float:
        return self.seconds_per_row * shape.lora_rows + self.seconds_per_slot * shape.lora_slots


@dataclass(slots=True)
class Profile:
    """What calibrate measured: the cost model and the fixed costs around it, and the model's
    facts the planner needs to size the KV pool the way the server does."""
    model: str
    device: str  # "cpu" or "cuda"
    dtype: str
    cost: CostModel
    kv_bytes_per_token: int  # one token's K and V, all layers, one rank
    max_model_len: int
    default_kv_cache_bytes: int  # the pool the server sizes with no --kv-cache-memory
    step_overhead_s: float = 0.0  # per step beyond the forward pass (scheduler <-> worker round trip)
    request_overhead_s: float = 0.0  # per request before the scheduler sees it (gateway, tokenizer, network)
    tokenize_s_per_token: float = 0.0  # text prompts only: the tokenizer's time per prompt token
    samples: list[dict] = field(default_factory=list)  # the measured steps: shape fields + seconds
    # The model's arithmetic, for the LoRA term (0 in profiles made before it: recalibrate)
    linear_macs_per_token: int = 0  # multiply-adds of one token through the decoder's linear layers
    lora_macs_per_rank: int = 0  # an adapted row's extra multiply-adds per unit of rank (also its values read)
    weight_bytes: int = 0  # the base weights the calibration ran on
    dtype_bytes: int = 4  # bytes of one activation-dtype value (the adapters' stacks)

    def step_time(self, shape: StepShape, lora: LoraCost | None = None) -> float:
        if not shape.tokens:
            return 0.0
        return self.cost.predict(shape) + self.step_overhead_s + (lora.seconds(shape) if lora else 0.0)

    def lora_cost(self, max_lora_rank: int) -> LoraCost:
        """What adapters of --max-lora-rank add (the stacks are that wide whatever an adapter's own
        rank): each adapted row rank x lora_macs_per_rank multiply-adds at the calibrated seconds
        per base multiply-add (per_token / linear_macs_per_token), each adapter in the step its
        stacks' bytes at the calibrated fixed step cost per base weight byte (fixed / weight_bytes)."""
        if not (self.linear_macs_per_token and self.lora_macs_per_rank and self.weight_bytes):
            raise ValueError("this profile predates the planner's LoRA term: make it again with `pagedserve calibrate`")
        macs = max_lora_rank * self.lora_macs_per_rank
        coef = self.cost.coefficients
        return LoraCost(seconds_per_row=coef["per_token"] * macs / self.linear_macs_per_token,
                        seconds_per_slot=coef["fixed"] * macs * self.dtype_bytes / self.weight_bytes)

    def to_json(self) -> dict:
        return {"version": PROFILE_VERSION, **asdict(self)}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        data = json.loads(Path(path).read_text())
        if data.pop("version", None) != PROFILE_VERSION:
            raise ValueError(f"{path}: not a pagedserve calibration profile (version {PROFILE_VERSION}); "
                             f"make one with `pagedserve calibrate --out {path}`")
        cost = data.pop("cost")
        cost = CostModel(cost["coefficients"], cost["knee"], FitReport(**cost["fit"]))
        return cls(cost=cost, **data)
