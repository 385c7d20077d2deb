#!/usr/bin/env bash
# `make gpu-prepare`, where the package registry is (not on the GPU machine). Fills the project's .gpu/
# (git-ignored by .gitignore): wheels of the project's dependencies that the GPU machine's image lacks, the
# default model's tokenizer files, and the scripts. Then, on the GPU machine: bash .gpu/check.sh [stages]
# PYTHON: the interpreter whose packages are pinned (default: the project's .venv/bin/python).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(git -C "$here" rev-parse --show-toplevel)"; cd "$root"  # a worktree's root too (.git may be a file)
mkdir -p .gpu/whl .gpu/tok
cp "$here"/check.sh "$here"/make_model.py "$here"/make_gptq.py "$here"/profile_step.py .gpu/
py="${PYTHON:-.venv/bin/python}"; [ -x "$py" ] || py=python3
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's pagedserve, installed or not
# The GPU image has torch, triton, transformers, tokenizers, numpy, safetensors, jinja2, httpx, uvloop, psutil,
# prometheus-client, pyyaml, pytest, hypothesis; these it lacks, pinned as installed here:
pkgs="gguf redis grpcio grpcio-health-checking grpcio-reflection protobuf fastapi starlette pydantic pydantic_core annotated-types typing-inspection uvicorn llguidance"
pins=$($py -m pip list --format=freeze 2>/dev/null | python3 -c "
import sys; want={p.lower().replace('_','-') for p in '$pkgs'.split()}
print(' '.join(l.strip() for l in sys.stdin if l.split('==')[0].lower().replace('_','-') in want))")
plat=""; for n in 17 24 27 28 31 34 35; do plat="$plat --platform manylinux_2_${n}_x86_64"; done
for p in $pins; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $plat --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .gpu/whl "$p"
done
tok="$($py -c 'from pagedserve.model_files.default_model import ensure_default_model as e; print(e(progress=False))' 2>/dev/null | tail -1)"
[ -d "$tok" ] || tok="$(dirname "$tok")"
for f in tokenizer.json tokenizer_config.json chat_template.jinja generation_config.json; do
  [ -f "$tok/$f" ] && cp "$tok/$f" .gpu/tok/
done
du -sh .gpu; ls .gpu/whl | wc -l
echo 'on the GPU machine: bash .gpu/check.sh [tests] [e2e] [speed] [services]'
