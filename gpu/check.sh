#!/usr/bin/env bash
# On the GPU machine, from the project's root: bash .gpu/check.sh [tests] [e2e] [speed] [services] [sampled] [tune] [int4] [vision]
# (default: all but sampled, tune, int4 and vision). Writes summary.txt (a line per stage) and at most 9 files to $OUT (default: .gpu/out).
G="$(cd "$(dirname "$0")" && pwd)"; P="$(cd "$G/.." && pwd)"; M=/tmp/m1b
OUT="${OUT:-$G/out}"; mkdir -p "$OUT"; S=$OUT/summary.txt
want() { [ -z "$STAGES" ] || [[ " $STAGES " == *" $1 "* ]]; }
named() { [[ " $STAGES " == *" $1 "* ]]; }  # a stage run only when named
STAGES="$*"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$G"/whl/*.whl \
  > /tmp/pip.log 2>&1 || echo "pip: $(tail -3 /tmp/pip.log)" >> "$S"
export PYTHONPATH=/tmp/site:$P
mkdir -p /tmp/bin; printf '#!/bin/sh\nexec python3 -m pagedserve.cli "$@"\n' > /tmp/bin/pagedserve; chmod +x /tmp/bin/pagedserve
export PATH=/tmp/bin:$PATH
cd "$P"
echo "env: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader) | $(python3 -c 'import torch,triton;print(torch.__version__,triton.__version__)') | $(git log --oneline -1 2>/dev/null)" >> "$S"
line() { echo "$1 rc=$2 $3s :: $(tail -3 "$4" | tr '\n' ' ' | cut -c1-300)" >> "$S"; }
if want tests; then  # each GPU test in its own process: one CUDA fault poisons only its own context
  t0=$(date +%s)
  python3 -m pytest -q --collect-only -p no:cacheprovider tests/test_triton_kernels.py tests/test_triton_window_softcap.py tests/test_triton_fused_ops.py tests/test_triton_seeded_draws.py tests/test_triton_nucleus.py tests/test_int4_weights.py tests/test_deepseek.py 2>/dev/null | grep "::" > /tmp/ids
  xargs -a /tmp/ids -P 12 -I{} sh -c 'timeout 120 python3 -m pytest -q -x -p no:cacheprovider "{}" > /tmp/one.$$.log 2>&1; rc=$?; if [ $rc = 0 ]; then echo "PASS {}"; else echo "FAIL(rc=$rc) {}"; grep -E "^E |Error" /tmp/one.$$.log | head -4 | cut -c1-240; fi' > "$OUT/tests.log" 2>&1
  echo "tests $(( $(date +%s) - t0 ))s: $(grep -c ^PASS "$OUT/tests.log") pass, $(grep -c ^FAIL "$OUT/tests.log") fail (rc=124: timed out at 120 s)" >> "$S"
fi
if want e2e; then  # the engine on CUDA against transformers on the CPU, tiny models
  t0=$(date +%s)
  timeout 360 python3 -m pytest -q -p no:cacheprovider -m "not slow and not heavy" tests/test_engine_equivalence.py \
    tests/test_moe_models.py tests/test_qwen3_phi3.py tests/test_gemma3.py tests/test_tensor_parallel.py \
    tests/test_llava.py tests/test_llava_graphs.py tests/test_idefics3.py \
    tests/test_cuda_setup.py tests/test_device_memory.py tests/test_graph_runner.py tests/test_mixed_graphs.py tests/test_step_overlap.py tests/test_platform.py tests/test_cuda_profile.py \
    tests/test_sampler.py -rs > "$OUT/e2e.log" 2>&1
  line e2e $? $(( $(date +%s) - t0 )) "$OUT/e2e.log"
fi
if named vision; then  # the newer image families on CUDA against transformers on the CPU (eager image steps, M-RoPE's
  # shift through the graphs, Gemma 3's bidirectional keys in the Triton prefill kernel, Pixtral's spans)
  t0=$(date +%s)
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m "not heavy" tests/test_qwen2_vl.py tests/test_qwen2_vl_graphs.py \
    tests/test_qwen2_vl_decode_graphs.py tests/test_gemma3_vl.py tests/test_attention_key_limits.py tests/test_pixtral.py \
    -rs > "$OUT/vision.log" 2>&1
  line vision $? $(( $(date +%s) - t0 )) "$OUT/vision.log"
fi
if want speed || want services || named tune || named sampled || named int4; then timeout 60 python3 "$G/make_model.py" $M "$G/tok" > /tmp/model.log 2>&1 || echo "model: $(tail -2 /tmp/model.log)" >> "$S"; fi
if want speed; then
  t0=$(date +%s); { timeout 150 pagedserve bench throughput --model $M --device cuda --num-prompts 1024 --max-num-seqs 256 \
    --baseline-batch-sizes 256; timeout 60 pagedserve bench latency --model $M --device cuda --input-len 128 --output-len 256
    # the same stream with each step finished before the next begins: what async scheduling gains
    timeout 60 pagedserve bench latency --model $M --device cuda --input-len 128 --output-len 256 --no-async-scheduling
    # W1024 with decode graphs alone: what capturing the mixed steps (two thirds of its steps) gains
    timeout 90 pagedserve bench throughput --model $M --device cuda --num-prompts 1024 --max-num-seqs 256 --no-baseline \
      --compilation-config '{"cudagraph_mode": "FULL_DECODE_ONLY"}'; } > "$OUT/speed.log" 2>&1
  line speed $? $(( $(date +%s) - t0 )) "$OUT/speed.log"
  echo "one stream, async scheduling on / off: $(grep -o 'decode [0-9.]* tok/s' "$OUT/speed.log" | tr '\n' ' ')" >> "$S"
  echo "W1024, mixed graphs on / off: $(grep -o '^pagedserve: .* tok/s)' "$OUT/speed.log" | grep -o '([0-9.]* tok/s)' | tr '\n' ' ')" >> "$S"
  echo "graph capture at start-up: $(grep -o 'graphs captured in .*' "$OUT/speed.log" | head -2 | tr '\n' ' '); the KV budget kept out for them: $(grep -o 'CUDA graphs ~[0-9.]* GiB' "$OUT/speed.log" | head -2 | tr '\n' ' ')" >> "$S"
  t0=$(date +%s); timeout 120 python3 "$G/profile_step.py" $M > "$OUT/profile.log" 2>&1; line profile $? $(( $(date +%s) - t0 )) "$OUT/profile.log"
  t0=$(date +%s); timeout 90 python3 -m pagedserve.kernels.bench > "$OUT/kbench.log" 2>&1; line kbench $? $(( $(date +%s) - t0 )) "$OUT/kbench.log"
  echo "kbench % of floor: $(grep -E '[0-9]x ' "$OUT/kbench.log" | awk '{k=substr($0,1,18); gsub(/ +$/,"",k); printf "%s %s; ", k, $(NF-1)}')" >> "$S"
  echo "top_p nucleus (256 x 49,152), kernel / torch.sort ms, speedup: $(grep '^top_p nucleus' "$OUT/kbench.log" | awk '{print $(NF-6), $(NF-4), $(NF-3)}')" >> "$S"
fi
if named sampled; then  # W1024 sampled as clients sample: top_p alone (the nucleus kernel), then penalties too
  t0=$(date +%s); for flags in "--temperature 0.8 --top-p 0.95" "--temperature 0.8 --top-p 0.95 --repetition-penalty 1.1 --frequency-penalty 0.3"; do
    echo "flags: $flags"; timeout 100 pagedserve bench throughput --model $M --device cuda --num-prompts 1024 --max-num-seqs 256 \
      --no-baseline $flags; done > "$OUT/sampled.log" 2>&1
  line sampled $? $(( $(date +%s) - t0 )) "$OUT/sampled.log"
  echo "W1024 sampled, top_p 0.95 / with penalties: $(grep -o '^pagedserve: .* tok/s)' "$OUT/sampled.log" | grep -o '([0-9.]* tok/s)' | tr '\n' ' ')" >> "$S"
fi
if named tune; then  # the kernels' launch configs measured here; the table comes back as kernel_configs.json
  t0=$(date +%s); timeout 330 python3 -m pagedserve.kernels.tune --budget-s 280 --out "$OUT/kernel_configs.json" \
    > "$OUT/tune.log" 2>&1; line tune $? $(( $(date +%s) - t0 )) "$OUT/tune.log"
  # the 1B stream with the table against without, alternated
  t0=$(date +%s); for cfg in "" "$OUT/kernel_configs.json" "" "$OUT/kernel_configs.json"; do
    echo "PAGEDSERVE_KERNEL_CONFIGS=$cfg"; PAGEDSERVE_KERNEL_CONFIGS=$cfg timeout 45 pagedserve bench latency --model $M \
      --device cuda --input-len 128 --output-len 256; done > "$OUT/tuned_speed.log" 2>&1
  line tuned_speed $? $(( $(date +%s) - t0 )) "$OUT/tuned_speed.log"
  echo "one stream, untuned / tuned (alternating): $(grep -o 'decode [0-9.]* tok/s' "$OUT/tuned_speed.log" | tr '\n' ' ')" >> "$S"
fi
if named int4; then  # the 1B's GPTQ twin on the int4 kernel against the bfloat16 model, one stream, alternating
  t0=$(date +%s); timeout 60 python3 "$G/make_gptq.py" $M /tmp/m1b-gptq > /tmp/gptq.log 2>&1 || echo "gptq: $(tail -2 /tmp/gptq.log)" >> "$S"
  for m in /tmp/m1b-gptq $M /tmp/m1b-gptq $M; do echo "model $m"; timeout 60 pagedserve bench latency --model $m --device cuda \
    --input-len 128 --output-len 256; done > "$OUT/int4.log" 2>&1
  line int4 $? $(( $(date +%s) - t0 )) "$OUT/int4.log"
  echo "one stream, GPTQ int4 / bfloat16 (alternating): $(grep -o 'decode [0-9.]* tok/s' "$OUT/int4.log" | tr '\n' ' ')" >> "$S"
fi
if want services; then
  t0=$(date +%s); timeout 180 pagedserve bench services --model $M --device cuda --workload w64 --num-prompts 256 \
    --concurrency 64 --repeats 1 > "$OUT/services.log" 2>&1
  line services $? $(( $(date +%s) - t0 )) "$OUT/services.log"
fi
cat "$S"
