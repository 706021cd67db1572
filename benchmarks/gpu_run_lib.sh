# What benchmarks/next_gpu_run.sh and benchmarks/targets_gpu_run.sh share (sourced, not run): the
# environment, the budget's clock, `step` (a command under its own deadline within BUDGET seconds)
# and `suite` (one part of the GPU benchmark suite, its JSON kept); everything goes into one file,
# $OUT/run.tgz, remade after every step: the logs, each step's JSON, the fp32 references made on the
# way (benchmarks/results/references/, to commit), the GPU's name and the commit. The caller sets
# WORK (its folder) before sourcing this.
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
BUDGET=${BUDGET:-570}
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

suite() {  # name, seconds, pytest -k selection[, pytest options]: one part of the GPU benchmark suite, its JSON kept
  local name=$1 seconds=$2 selection=$3
  shift 3
  step "$name" "$seconds" python3 benchmarks/run.py --size gpu --json "$WORK/gpu-$name.json" \
    --out "$WORK/gpu-$name.md" -k "$selection" "$@"
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > "$WORK/gpu.txt" 2>&1
git log -1 --format='%H %s' > "$WORK/commit.txt" 2>/dev/null
pack
