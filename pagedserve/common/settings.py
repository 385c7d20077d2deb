"""Every setting of pagedserve, declared once (in the manner of vLLM's EngineArgs).

A Setting (setting_spec.py) is one command-line flag: its type, default, help, the environment variable that also
sets it (PAGEDSERVE_ and the flag's name in capitals, dashes as underscores: --max-num-seqs is
PAGEDSERVE_MAX_NUM_SEQS; the command line wins) and the services that take it:

    engine      the in-process engine: generate, chat, the benches (no environment variables)
    serve       the launcher, which hands each child the settings they both take (argv_for)
    worker, scheduler, tokenizer, gateway     each service alone

SETTINGS is the one table, here. Every parser takes its slice with add_settings(parser, service); the
launcher builds its children's command lines with argv_for and their secrets' environment with
secret_env (both settings_cli.py); compose sets the same variables. A flag that means different things to different
services (--port: 8000 on the gateway, 50060 on the scheduler) is declared once per meaning.

Invariants (checked at import): a service never takes two settings of one name; every service
named exists. The defaults computed from other settings (the step token budget by device, the
long-prefill cap) are computed by step_budgets only. Standard library only: no torch here (the
import-linter contract), since every service process builds its parser from this table.
"""

from __future__ import annotations

from typing import Any

from pagedserve.common.checkpoint_quantization import CHECKPOINT_METHODS
from pagedserve.common.lora import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS
from pagedserve.common.replicas import (DEFAULT_HEARTBEAT_INTERVAL_S, DEFAULT_HEARTBEAT_TTL_S,
                                        DEFAULT_PUBLISHED_BLOCKS)
from pagedserve.common.sampling_params import MAX_LOGPROBS
from pagedserve.common.setting_spec import SERVICES, Setting
from pagedserve.common.store import DEFAULT_PREFIX, DEFAULT_RETENTION_S, DEFAULT_TTL_S

LOOPBACK = "127.0.0.1"
DEFAULT_PORTS = {"http": 8000, "grpc": 50051, "tokenizer": 50052, "scheduler": 50060, "worker": 50061}


# ---- the defaults computed from other settings -----------------------------------------------
CPU_MAX_NUM_BATCHED_TOKENS = 512  # small steps mix prefill chunks into decodes (+8% on W64 over 2048)
CUDA_MAX_NUM_BATCHED_TOKENS = 2048
# One request prefills at most this share of the step budget a step: a quarter on CUDA, an eighth on
# the CPU, where a step of 128 prompt tokens took ~140 ms on two cores and a short prompt arriving
# meanwhile waited for it (64: ~75 ms; a 1,800-token prompt's own TTFT +3%: `pagedserve bench behind`).
CUDA_LONG_PREFILL_SHARE = 4
CPU_LONG_PREFILL_SHARE = 8


def step_budgets(max_num_batched_tokens: int | None, long_prefill_token_threshold: int | None,
                 device: str) -> tuple[int, int]:
    """(max_num_batched_tokens, long_prefill_token_threshold) as configured, or their defaults:
    the budget 512 on CPU and 2048 on CUDA (device: "cpu", "cuda", "cuda:0", a torch.device),
    the threshold an eighth of the budget on CPU, a quarter on CUDA (0 stays 0: no cap)."""
    cuda = str(device).startswith("cuda")
    budget = max_num_batched_tokens or (CUDA_MAX_NUM_BATCHED_TOKENS if cuda else CPU_MAX_NUM_BATCHED_TOKENS)
    share = CUDA_LONG_PREFILL_SHARE if cuda else CPU_LONG_PREFILL_SHARE
    threshold = budget // share if long_prefill_token_threshold is None else long_prefill_token_threshold
    return budget, threshold


# ---- the declaration ---------------------------------------------------------------------------
def _settings() -> tuple[Setting, ...]:
    S = Setting
    ports = DEFAULT_PORTS
    internal = "address to bind (internal service: keep it private)"
    return (
        # ---- where each service listens and whom it calls ----------------------------------
        S("--host", "serve gateway", default=LOOPBACK, help="address of the public APIs (HTTP and gRPC)"),
        S("--host", "scheduler tokenizer worker", default=LOOPBACK, help=internal),
        S("--port", "serve gateway", int, ports["http"], "HTTP port of the OpenAI-compatible API"),
        S("--port", "scheduler", int, ports["scheduler"], "gRPC port of the scheduler"),
        S("--port", "tokenizer", int, ports["tokenizer"], "gRPC port of the tokenizer"),
        S("--port", "worker", int, ports["worker"], "gRPC port of this worker rank"),
        S("--grpc-port", "serve gateway", int, ports["grpc"], "port of the public gRPC Generate API"),
        S("--worker-addrs", "scheduler", default=f"{LOOPBACK}:{ports['worker']}",
          help="comma-separated host:port of worker ranks 0..N-1"),
        S("--tokenizer-addr", "gateway", default=f"{LOOPBACK}:{ports['tokenizer']}", help="the tokenizer's host:port"),
        S("--scheduler-addr", "tokenizer gateway", default=f"{LOOPBACK}:{ports['scheduler']}", help="the host:port"),
        S("--redis-url", "serve", help="use this Redis (redis://host:port/db, or 'memory': durability off)",
          default_text="a private redis-server if one is on the PATH, else an in-process store"),
        S("--redis-url", "scheduler", help="redis://host:port/db; 'memory': an in-process store",
          default_text="an in-process store"),
        S("--redis-url", "gateway", help="redis://host:port/db where the request records are; 'memory': none",
          default_text="none: ask the scheduler"),
        S("--redis-url", "tokenizer", help="redis://host:port/db of the engine replicas' registry: requests are "
          "routed over the replicas registered there (docs/scale-out.md)",
          default_text="none: the one scheduler at --scheduler-addr"),
        S("--redis-prefix", "scheduler gateway tokenizer", default=DEFAULT_PREFIX,
          help="key prefix of the request records and the replica registry"),
        S("--redis-ttl", "scheduler gateway", int, DEFAULT_TTL_S,
          "seconds the record of an unfinished request is kept (a restarted scheduler resumes it from there)"),
        S("--request-retention", "serve scheduler gateway", int, DEFAULT_RETENTION_S,
          "seconds a finished request's record (prompt, outputs, timings), its Idempotency-Key and its resume "
          "record are kept (GET /v1/requests/{id}, retries and resumes find it until then)"),
        # ---- engine replicas (data parallel; docs/scale-out.md) ----------------------------
        S("--data-parallel-size", "serve", int, 1, "engine replicas to start (each: its worker ranks and a "
          "scheduler), behind one tokenizer that routes over them; more than 1 needs Redis", group="replicas",
          aliases=("-dp",)),
        S("--routing-policy", "serve tokenizer", default="prefix", choices=("prefix", "least_load", "round_robin"),
          help="how a request's replica is picked: prefix (the one whose prefix cache holds most of the prompt, "
          "unless it is much busier), least_load (fewest queued and running tokens), round_robin", group="replicas"),
        S("--replica-id", "scheduler", default="", group="replicas",
          help="this scheduler is engine replica ID: it registers in Redis (--redis-url) and heart-beats; keep "
          "it stable across restarts (a restarted replica resumes its own requests); empty: a single engine"),
        S("--advertise-addr", "scheduler", group="replicas", default_text="--host:--port",
          help="host:port where tokenizers and gateways reach this replica's scheduler"),
        S("--heartbeat-interval", "scheduler", float, DEFAULT_HEARTBEAT_INTERVAL_S, group="replicas",
          help="seconds between a replica's heartbeats (load and prefix-cache change published each time)"),
        S("--heartbeat-ttl", "serve scheduler", float, DEFAULT_HEARTBEAT_TTL_S, group="replicas",
          help="seconds a replica stays in routing after its last heartbeat; then its streams move to "
          "another replica"),
        S("--published-prefix-blocks", "scheduler", int, DEFAULT_PUBLISHED_BLOCKS, group="replicas",
          help="most prefix-cache block hashes a replica publishes (its most recently cached)"),
        # ---- the launcher ------------------------------------------------------------------
        S("--redis-maxmemory", "serve", default="256mb", group="launcher", help="memory cap of the private "
          "redis-server (when no --redis-url is given), in Redis' units (e.g. 256mb, 1gb); beyond it the least "
          "recently used records are evicted (volatile-lru: every record has a TTL)"),
        S("--disable-log-requests", "serve", bool, False, group="launcher",
          help="vLLM's: taken so that its command lines start; requests are never logged here at info level"),
        S("--log-dir", "serve", help="write each service's output to LOG_DIR/<service>.log",
          default_text="this terminal", group="launcher"),
        S("--startup-timeout", "serve", float, 600.0,
          "seconds each service may take to turn healthy (the worker loads the model)", group="launcher"),
        S("--stop-timeout", "serve", float, 10.0, "seconds each service gets after SIGTERM before SIGKILL",
          group="launcher"),
        S("--max-restarts", "serve", int, 5,
          "restart a service that dies (with backoff; if one tensor-parallel worker rank dies, all ranks "
          "restart); more than this many restarts within --restart-window and everything stops. 0: stop "
          "everything when any service dies", group="launcher"),
        S("--restart-window", "serve", float, 300.0, "seconds (see --max-restarts)", group="launcher"),
        S("--tls-cert", "serve", help="PEM certificate for TLS between the internal services",
          default_text="plain TCP inside", group="launcher"),
        S("--tls-key", "serve", help="its PEM private key", group="launcher"),
        S("--tls-ca", "serve", help="PEM CA that signed every service's certificate (then clients must present "
          "one too)", group="launcher"),
        # ---- the engine ---------------------------------------------------------------------
        S("--model", "engine serve worker tokenizer",
          help="HF model folder, .gguf file, Hugging Face hub id (org/name; downloaded once into the HF cache) "
          "or a name from `pagedserve list`", default_text="SmolLM2-135M-Instruct", group="engine"),
        S("--revision", "engine serve worker tokenizer", help="a hub id's branch, tag or commit", group="engine"),
        S("--device", "engine serve worker", default="auto", choices=("auto", "cpu", "cuda"), group="engine",
          help="where the model runs (auto: CUDA when there is one)"),
        S("--dtype", "engine serve worker", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
          help="auto: bfloat16 on CUDA and on CPUs with avx512_bf16/AMX, else float32", group="engine"),
        S("--quantization", "engine serve worker", default="auto", choices=("auto", "none", "int8") + tuple(
            CHECKPOINT_METHODS), group="engine", help="auto: a GGUF's blocks (Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q6_K) kept "
          "on the CPU kernels, a checkpoint's 4-bit ones on those or CUDA's int4 kernel, else float; none: "
          "dequantize at load; int8: weight-only Q8_0 for any checkpoint; vLLM's method names (gptq, awq, fp8, "
          "bitsandbytes, ...): auto when the checkpoint is that, else an error"),
        S("--omp-wait-policy", "serve worker", default="brief", choices=("brief", "passive", "active", "runtime"),
          help="how the worker's idle OpenMP threads wait for the next parallel region: brief spins across the "
          "gaps inside a step and sleeps between steps (GOMP_SPINCOUNT=20000); passive sleeps at once, so a "
          "scheduler, tokenizer or gateway sharing the cores never waits behind a spinning thread; active "
          "spins; runtime leaves the OpenMP runtime's default. OMP_WAIT_POLICY or GOMP_SPINCOUNT in the "
          "environment win", group="engine"),
        S("--cpu-kernel-threads", "serve worker", default="pool", choices=("pool", "openmp"),
          help="how the worker's CPU kernels share a step's work: pool hands it out in small pieces, so a "
          "core the scheduler, tokenizer or gateway holds for a moment costs its share, not the whole "
          "kernel's wait (kernels/cpu/work_pool.h); openmp splits it up front as torch does. The in-process "
          "engine uses openmp unless PAGEDSERVE_WORK_POOL=1", group="engine"),
        S("--seed", "serve worker", int, None, group="engine", default_text="unseeded",
          help="vLLM's: the worker's random number generators start from this seed, so requests without a seed "
          "of their own draw the same tokens for the same sequence of steps"),
        S("--trust-remote-code", "engine serve worker", bool, False, group="engine",
          help="vLLM's: taken so that its command lines start; no code from a model's folder ever runs here (only "
          "the architectures pagedserve implements load), so there is nothing to trust"),
        S("--kv-cache-dtype", "engine serve worker", default="auto", choices=("auto",), group="engine",
          help="vLLM's: the KV cache is kept in the model's dtype (fp8 caches are not implemented)"),
        S("--tensor-parallel-size", "engine serve worker", int, 1,
          "ranks the model is split across (one worker process each; in process, ranks 1..N-1 are spawned)",
          group="engine", aliases=("-tp",)),
        S("--max-model-len", "engine serve worker scheduler", int, None, "longest prompt + output in tokens",
          default_text="the model's", group="engine"),
        S("--block-size", "engine serve scheduler worker", int, 16, "tokens per KV-cache block", group="engine"),
        S("--kv-cache-memory", "engine serve scheduler worker", help="KV pool size: bytes or e.g. 512MiB, 2GiB",
          default_text="2GiB on CPU; on CUDA what --gpu-memory-utilization leaves", group="engine"),
        S("--gpu-memory-utilization", "engine serve scheduler worker", float, 0.9,
          "share of the GPU's memory the worker may use (weights, activations, KV pool)", group="engine"),
        S("--swap-space", "engine serve scheduler", default="1GiB", help="host pool for --preemption-mode swap",
          group="engine"),
        S("--max-logprobs", "engine serve scheduler", int, MAX_LOGPROBS, group="engine",
          help="most logprobs (and prompt logprobs) one request may ask for (vLLM's; -1: the vocabulary); "
          "more is a 400 naming the field"),
        S("--max-num-seqs", "engine serve scheduler worker", int, 128, "most sequences in one step",
          group="engine"),  # the worker: the largest decode batch it captures a CUDA graph for
        S("--enforce-eager", "engine serve worker", bool, False, "run every step eagerly: no CUDA graphs "
          "(CUDA only; the CPU always runs eagerly)", group="engine"),
        S("--compilation-config", "engine serve worker", default=None, group="engine",
          help="which steps replay CUDA graphs, as vLLM takes it: a JSON object with cudagraph_mode "
          "FULL_AND_PIECEWISE or FULL (decode and mixed steps, captured whole), FULL_DECODE_ONLY or NONE",
          default_text='{"cudagraph_mode": "FULL_AND_PIECEWISE"}'),
        S("--cudagraph-capture-sizes", "engine serve worker", int, many=True, several=True, group="engine",
          help="vLLM's: the sizes CUDA graphs are captured at (decode steps: rows; mixed steps: tokens), as "
          "--compilation-config's cudagraph_capture_sizes", default_text="1, 2, 4, then every 8 up to --max-num-seqs"),
        S("--cuda-graph-sizes", "engine serve worker", int, many=True, several=True, group="engine",
          help="vLLM's older flag, as its command lines meant it: one value is --max-cudagraph-capture-size, "
          "several are --cudagraph-capture-sizes", default_text="unset"),
        S("--max-cudagraph-capture-size", "engine serve worker", int, None, group="engine",
          help="vLLM's: the default capture sizes up to this one, as --compilation-config's max_cudagraph_capture_size",
          default_text="no bound"),
        S("--max-num-batched-tokens", "engine serve scheduler worker", int, None,
          "token budget of one step, prefill chunks and decodes together",
          default_text=f"{CPU_MAX_NUM_BATCHED_TOKENS} on CPU, {CUDA_MAX_NUM_BATCHED_TOKENS} on CUDA", group="engine"),
        S("--long-prefill-token-threshold", "engine serve scheduler", int, None,
          "most prompt tokens one request prefills per step (0: no cap); a prompt of at most this many "
          "tokens is short: a longer prefill leaves every other step to short prompts waiting",
          default_text=f"--max-num-batched-tokens / {CPU_LONG_PREFILL_SHARE} on CPU, / {CUDA_LONG_PREFILL_SHARE} "
          "on CUDA", group="engine"),
        S("--preemption-mode", "engine serve scheduler", default="recompute", choices=("recompute", "swap"),
          help="what happens to a preempted request's KV blocks", group="engine"),
        S("--scheduling-policy", "engine serve scheduler", default="fcfs", choices=("fcfs", "priority"),
          help="the order waiting requests are admitted in: arrival, or each request's priority", group="engine"),
        S("--runner", "engine serve gateway", default="auto", choices=("auto", "generate", "pooling"),
          help="vLLM's: generate (auto) serves completions, chat, responses and messages; pooling serves "
          "/v1/embeddings (and the offline LLM.embed) and refuses the others", group="engine"),
        S("--pooler", "engine serve gateway", default="last", choices=("last", "mean", "cls"),
          help="with --runner pooling: how a prompt's hidden states (after the final norm) become its "
          "embedding: the last token's, the mean over the prompt, or the first token's", group="engine"),
        S("--no-prefix-caching", "engine serve scheduler", bool, False, "do not share KV blocks of equal prefixes",
          group="engine", aliases=("--no-enable-prefix-caching",), opposites=("--enable-prefix-caching",)),
        S("--no-chunked-prefill", "engine serve scheduler", bool, False, "prefill each prompt in one step",
          group="engine", aliases=("--no-enable-chunked-prefill",), opposites=("--enable-chunked-prefill",)),
        # ---- LoRA adapters (common/lora.py, worker/lora; vLLM's flags) ----------------------
        S("--enable-lora", "engine serve scheduler worker gateway", bool, False, group="lora",
          help="serve LoRA adapters (PEFT folders) of the model: a request names one as its \"model\""),
        S("--lora-modules", "engine serve gateway", many=True, group="lora",
          help="an adapter served from the start, as name=path (a PEFT folder: adapter_config.json and "
          "adapter_model.safetensors); repeat for several; more at run time with POST /v1/load_lora_adapter"),
        S("--max-loras", "engine serve scheduler worker", int, DEFAULT_MAX_LORAS, group="lora",
          help="most adapters in one step (each holds a slot of stacked weights on the device)"),
        S("--max-lora-rank", "engine serve worker gateway", int, DEFAULT_MAX_LORA_RANK, group="lora",
          help="the largest adapter rank served (the slots are this wide)"),
        S("--max-cpu-loras", "engine serve worker", int, None, group="lora", default_text="--max-loras",
          help="most adapters the worker keeps loaded in host memory (least recently used evicted)"),
        S("--speculative-config", "engine serve scheduler worker", default=None,
          help="speculative decoding as vLLM takes it, a JSON object: {\"method\": \"ngram\", "
          "\"num_speculative_tokens\": 4, \"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5} (n-gram prompt "
          "lookup: proposals copied from the request's own prompt and output) or {\"method\": \"draft_model\", "
          "\"model\": PATH, \"num_speculative_tokens\": 4} (a smaller model of the same vocabulary proposes, in the "
          "worker, its KV in the same blocks); verified exactly: greedy outputs "
          "are unchanged, sampled ones keep their distribution. Rows with structured outputs are not "
          "speculated", default_text="off", group="engine"),
        # ---- the scheduler ------------------------------------------------------------------
        S("--max-waiting-requests", "serve scheduler", int, 1024,
          "bound on the waiting queue: beyond it requests get RESOURCE_EXHAUSTED (HTTP 429)", group="scheduler"),
        S("--worker-timeout", "scheduler", float, 600.0, "seconds to wait for the workers to load and answer",
          group="scheduler"),
        S("--orphan-timeout", "scheduler", float, 60.0,
          "after a restart, seconds a re-admitted request waits for its stream to re-attach before it is aborted",
          group="scheduler"),
        S("--step-timeout", "serve scheduler", float, 60.0,
          "seconds a worker step may take before the rank counts as dead: the scheduler then waits for the "
          "workers to come back and resumes every request by recompute", group="scheduler"),
        S("--no-async-scheduling", "engine serve scheduler", bool, False,
          "schedule each step only after the last one's results are in; by default the scheduler schedules and "
          "sends step N+1 while the worker runs a short decode step N (vLLM's async scheduling), so the worker "
          "does not wait for it between steps, and the in-process engine on a GPU begins step N+1 before it "
          "takes step N's tokens (its rows read N's sampled ids on the device)", group="scheduler",
          opposites=("--async-scheduling",)),
        S("--disable-log-stats", "serve scheduler", bool, False, group="scheduler",
          help="no periodic stats line in the scheduler's log (every 10 s of steps: prompt and generation "
          "throughput, running and waiting requests, KV cache usage, prefix cache hit rate; vLLM's flag)"),
        S("--worker-transport", "serve scheduler", default="auto", choices=("auto", "grpc"),
          help="how steps reach the worker ranks: auto uses a rank's local step link (a Unix socket it names, "
          "same messages, no gRPC threads on either side) when the rank is on this host, else the gRPC Step "
          "stream; grpc always uses the Step stream", group="scheduler"),
        S("--stall-timeout", "serve scheduler", float, 30.0,
          "health turns NOT_SERVING when work is pending and no step completed for this long", group="scheduler"),
        # ---- the tokenizer ------------------------------------------------------------------
        S("--served-model-name", "serve tokenizer", many=True, several=True, group="tokenizer",
          help="the names clients may pass as model (vLLM's: several after one flag); answers and /v1/models "
          "name the first", default_text="the model folder's name"),
        S("--tokenizer", "engine serve tokenizer worker", help="a folder with the tokenizer files, for a model "
          "folder that has none (the worker reads its end-of-sequence token)", default_text="the model's folder",
          group="tokenizer"),
        S("--generation-config", "engine serve tokenizer", default="auto", group="tokenizer",
          help="where a request's unset temperature, top_p, top_k, min_p, repetition_penalty and max_tokens "
          "(max_new_tokens) come from (vLLM's flag): auto = the model's generation_config.json, a folder = "
          "that folder's, vllm = the engine's defaults"),
        S("--override-generation-config", "engine serve tokenizer", group="tokenizer",
          help="JSON object of generation-config entries over --generation-config's, e.g. '{\"temperature\": 0.5}'"),
        S("--chat-template", "engine serve tokenizer", help="a Jinja chat template file (or the template itself) "
          "used instead of the model's", default_text="the model's", group="tokenizer"),
        S("--service-transport", "serve tokenizer gateway", default="auto", choices=("auto", "grpc"),
          help="how the gateway calls the tokenizer's Generate and the tokenizer the scheduler's Stream: auto uses "
          "the callee's local socket (same messages over a Unix socket, no gRPC threads) when it runs on this "
          "host as this user, else gRPC; grpc always uses gRPC", group="tokenizer"),
        S("--scheduler-retry-timeout", "tokenizer", float, 120.0, "seconds a stream waits for a restarted scheduler "
          "before it fails", group="tokenizer"),
        # ---- a worker rank ------------------------------------------------------------------
        S("--rank", "worker", int, 0, "this worker's rank in the tensor-parallel group"),
        S("--dist-init-addr", "worker", help="host:port where the ranks meet (torch.distributed)",
          default_text="MASTER_ADDR:MASTER_PORT"),
        # ---- the gateway --------------------------------------------------------------------
        S("--api-key", "serve gateway", many=True, secret=True, group="gateway", help="require a bearer key; repeat"),
        S("--admin-api-key", "serve gateway", many=True, secret=True, group="gateway",
          help="an operator key: it sees every request in /v1/engine/stats and the dashboard, and reads /docs; "
          "repeat for several (ordinary keys see only their own requests)"),
        S("--published-address", "gateway", group="gateway", default_text="--host",
          help="the address clients reach this gateway on, when it differs from --host (compose sets the host's "
          "bind address); a non-loopback one needs an API key"),
        S("--allow-unauthenticated", "serve gateway", bool, False, group="gateway",
          help="serve a non-loopback address without any API key (anyone who reaches it may use it)"),
        S("--api-key-file", "serve gateway", help="a file of accepted API keys, one a line (# comments); "
          "`KEY min_priority=N` lets that key's requests set priority down to N (lower runs earlier; "
          "an ordinary key's floor is 0, an operator key has none)", group="gateway"),
        S("--cors-origins", "serve gateway", default="", aliases=("--allowed-origins",),
          help="comma-separated origins allowed by CORS ('*' for any), or vLLM's JSON list ('[\"https://a\"]'); "
          "empty: CORS off", group="gateway"),
        S("--disable-fastapi-docs", "serve gateway", bool, False, group="gateway",
          help="serve no /docs, /redoc or /openapi.json (vLLM's; they want the operator key anyway)"),
        S("--uvicorn-log-level", "serve gateway", default="warning", group="gateway",
          choices=("critical", "error", "warning", "info", "debug", "trace"),
          help="the HTTP server's log level (vLLM's flag; its default there is info)"),
        S("--ssl-keyfile", "serve gateway", group="gateway", default_text="plain HTTP", help="the API's PEM key: "
          "with --ssl-certfile (its PEM certificate) the API is HTTPS (vLLM's flags, as the next three)"),
        S("--ssl-certfile", "serve gateway", group="gateway", help="the API's PEM certificate (chain)"),
        S("--ssl-ca-certs", "serve gateway", group="gateway", help="PEM CA certificates to verify clients' by"),
        S("--ssl-cert-reqs", "serve gateway", int, 0, "HTTPS client certificates: 0 no, 1 optional, 2 required",
          group="gateway"),
        S("--max-body-bytes", "serve gateway", int, 1 << 20, "larger request bodies get 413 (0: no limit)",
          group="gateway"),
        S("--max-n", "serve gateway", int, 16, "the largest n (samples per request)", group="gateway"),
        S("--max-tokens-in-flight", "serve gateway", int, 0,
          "bound on the sum of prompt + n * max_tokens of admitted requests; beyond it 429 (0: no bound)",
          group="gateway"),
        S("--rate-limit", "serve gateway", help="RPS[:BURST] requests per second per API key (per client address "
          "without keys); beyond it 429 with Retry-After", default_text="no limit", group="gateway"),
        S("--shutdown-timeout", "serve gateway", float, 30.0, "on SIGTERM, seconds in-flight requests may take to "
          "finish (503 to new ones) before they are aborted", group="gateway"),
        S("--tool-call-parser", "serve gateway",
          choices=("hermes", "llama3_json", "mistral", "deepseek_v3", "qwen3_coder", "pythonic", "granite"),
          help="how tool calls are read from the output of a chat request with tools and tool_choice "
          "\"auto\" (vLLM's names): hermes (Hermes, Qwen: <tool_call>{...}</tool_call>), llama3_json (Llama 3: "
          "{\"name\": ..., \"parameters\": ...}), mistral ([TOOL_CALLS]), deepseek_v3, qwen3_coder (XML), "
          "pythonic ([f(a=1)]), granite (<|tool_call|>[...]); unset: such requests get 400", group="gateway"),
        S("--enable-auto-tool-choice", "serve gateway", bool, False, group="gateway", help="vLLM's switch for "
          "--tool-call-parser (which it needs); a no-op here: the parser reads tool_choice \"auto\" when named"),
        S("--return-tokens-as-token-ids", "serve gateway", bool, False, group="gateway",
          help="logprob tokens are written \"token_id:<id>\" (vLLM's), for a request that does not set "
          "return_tokens_as_token_ids itself"),
        S("--reasoning-parser", "serve gateway", choices=("deepseek_r1", "qwen3", "granite"),
          help="how a chat's reasoning is read from its output (vLLM's names): deepseek_r1 (up to </think>), "
          "qwen3 (a <think>...</think> block at the start), granite (\"Here is my thought process:\" ... \"Here "
          "is my response:\"); it goes in message.reasoning_content and delta.reasoning_content, the rest is "
          "the content; unset: the output is all content", group="gateway"),
        S("--prefix-cache-scope", "serve gateway", str, "owner", choices=("owner", "global"),
          help="owner: a request shares prefix-cache blocks only with requests of the same API key "
          "(and cache_salt), so cached_tokens tells no key what another sent; global: every key's "
          "requests share them (without keys both are the same)", group="gateway"),
        S("--resume-grace", "serve gateway", float, 60.0, "seconds a stream's request keeps running after its "
          "gateway died, for a resume (GET /v1/requests/{id}/stream); 0: it is aborted at once", group="gateway"),
        # ---- images in requests (gateway/images.py) -----------------------------------------------------
        S("--limit-mm-per-prompt", "serve gateway", default="", default_text='{"image": 4}', group="gateway",
          help='vLLM\'s: JSON, the most images a request may carry (\'{"image": 2}\'); --allowed-media-domains '
          "(vLLM's, repeatable: the only hosts image URLs and their redirects may name; unset: any)"),
        S("--mm-processor-kwargs", "engine serve worker tokenizer", group="engine", default_text="none", help="vLLM's: "
          'JSON, overrides of the image processor\'s settings (Qwen2-VL \'{"max_pixels": 1003520}\'; the keys by '
          "family: common/processor_kwargs.py); an unknown key, a bad value or a text model is refused at start"),
        S("--allowed-media-domains", "serve gateway", many=True, several=True, group="gateway", default_text="any"),
        S("--media-fetch-timeout", "serve gateway", float, 5.0, "seconds to fetch an image URL", group="gateway"),
    )


SETTINGS: tuple[Setting, ...] = _settings()


def settings_of(service: str) -> list[Setting]:
    """The settings a service takes, in table order."""
    if service not in SERVICES:
        raise ValueError(f"unknown service {service!r}; one of {', '.join(SERVICES)}")
    return [s for s in SETTINGS if service in s.services]


def setting(service: str, dest: str) -> Setting:
    for s in settings_of(service):
        if s.dest == dest:
            return s
    raise KeyError(f"{service} takes no setting {dest!r}")


def defaults(service: str) -> dict[str, Any]:
    """dest -> default of every setting the service takes."""
    return {s.dest: s.default for s in settings_of(service)}


def shared(source: str, service: str) -> list[Setting]:
    """The settings both take (same declaration, so same meaning): what `source` hands `service`."""
    return [s for s in SETTINGS if source in s.services and service in s.services]


def _check_table() -> None:
    for service in SERVICES:
        names = [s.dest for s in settings_of(service)]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"{service} takes two settings named {twice}")


_check_table()
