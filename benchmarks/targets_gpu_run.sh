#!/usr/bin/env bash
# Issue 26's targets measured in one run on one GPU, for docs/benchmarks-gpu.md regenerated from that
# run alone (docs/measurements.md, "The targets run"): from the project's root on a machine with a
# CUDA GPU, onnxruntime-gpu and the project's dependencies importable, `bash
# benchmarks/targets_gpu_run.sh 1`, then on the same warm machine `bash benchmarks/targets_gpu_run.sh 2`
# (a device call runs at most 10 minutes; the parts' JSON are one run: the same machine, minutes apart).
# Part 1: the Qwen3-0.6B-shaped targets but the server's (prefill, MMLU, HellaSwag, rolling, generate);
# part 2: the score server, then the real SmolLM2 bf16 package's rows beside them. The fp32
# references a part makes come back with it (benchmarks/results/references/: commit them, and the
# next targets run skips them). Each step runs under its own deadline inside BUDGET seconds (570).
# tests/test_benchmark_pages.py checks that every selection here still collects.
PART=${1:-}
if [ "$PART" != 1 ] && [ "$PART" != 2 ]; then
  echo "part '$PART': there are parts 1 and 2 (bash benchmarks/targets_gpu_run.sh 1, then 2)" >&2
  exit 2
fi
WORK=/tmp/targets-gpu-run-$PART
source "$(dirname "$0")/gpu_run_lib.sh"
# lm-eval's hf and ortmodule as it loads by default, without the suite's variants
PLAIN="(hf or ortmodule) and not (share or chunks or tokenize or cuda-graph or pad64 or bf16-head or prefill-onnx or transformers-bf16)"

if [ "$PART" = 1 ]; then
  # the packages exported before the steps that time them
  step package 150 bash -c "cd benchmarks && python3 -c 'from conftest import QWEN3_0_6B; from ortmodule_dev import fixtures; print(fixtures.build(QWEN3_0_6B).package_dir, fixtures.build(fixtures.SMOLLM2_BF16_CUDA).package_dir)'"
  # prefill >= 45% of the dense bf16 peak on 32 x 512 tokens (with the prefill graph and packed-QKV rows)
  suite forward 90 "forward and qwen3"
  # MMLU-shaped >= 1,000 requests/s and >= 2x hf, the fp32 choice on >= 99% (its fp32 reference is kept)
  suite mmlu 120 "at_scale and qwen3 and mmlu and $PLAIN"
  # generate: batch 1 >= 1.2x onnxruntime-genai, batch 32 >= 3x transformers (CUDA-graph rows beside)
  suite generate 120 "generate and qwen3 and not fewshot and not whole_prompts and not transformers_bf16"
  # HellaSwag-shaped >= 2x hf; rolling >= 2x hf in tokens/s (their fp32 references made here the first time)
  suite hellaswag 150 "at_scale and qwen3 and hellaswag and $PLAIN"
  suite rolling 150 "at_scale and qwen3 and rolling and $PLAIN"
else
  # the score server >= 1,200 items/s at P99 < 500 ms (SGLang's shape, 40 to 160 requests/s)
  suite server 180 "server_load and qwen3 and reuse-auto"
  # the real SmolLM2 bf16 package beside the Qwen3 rows
  suite smollm2-forward 60 "forward and smollm2"
  suite smollm2-generate 90 "generate and smollm2 and not fewshot and not whole_prompts and not transformers_bf16"
  suite smollm2-scale 240 "at_scale and smollm2 and (mmlu or hellaswag or rolling) and $PLAIN"
fi
echo "done at $((SECONDS - start)) s" >> "$WORK/plan.log"
pack
