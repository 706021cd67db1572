#!/usr/bin/env bash
# The next decisions run of issue 26 (planned in session 58, docs/measurements.md "The decisions run"):
# from the project's root on a machine with a CUDA GPU, onnxruntime-gpu and the project's dependencies
# importable (PYTHONPATH as the caller set it), `bash benchmarks/next_gpu_run.sh`.
# Each step runs under its own deadline inside BUDGET seconds (default 570), so that what finished
# comes back when a later step runs long; everything comes back in $OUT/run.tgz (gpu_run_lib.sh).
# tests/test_benchmark_pages.py checks that every selection here still collects.
WORK=${WORK:-/tmp/next-gpu-run}
source "$(dirname "$0")/gpu_run_lib.sh"

# (0) the Qwen3-0.6B-shaped bf16 package, exported before the steps that time it (about 25 s once
# imports are warm; a fresh machine's cold imports took most of a minute in session 57)
step package 90 bash -c "cd benchmarks && python3 -c 'from conftest import QWEN3_0_6B; from ortmodule_dev import fixtures; print(fixtures.build(QWEN3_0_6B).package_dir)'"
# (1) rolling (the target furthest from 2x: 1.45x in session 57), lm-eval's hf against ortmodule as it loads
# and with scoring's normalizers as one compiled reduction (scoring.COMPILED_NORMALIZERS: in session 58's
# rolling profile the float32 conversion and log-softmax took about 35 of a batch's 195 ms); the fp32
# reference is kept, so no transformers fp32 run here; and the prefill graph (`ortmodule-prefill-onnx`: no KV
# written, never measured on rolling with the float32 head)
suite rolling 180 "at_scale and qwen3 and rolling and (hf or ortmodule) and not (share or chunks or tokenize or cuda-graph or pad64 or bf16-head or transformers-bf16)"
# (2) where a rolling batch's device time goes as the lm-eval backend loads the model (the LM head in
# float32, float32 logits), with the normalizers as they are and compiled (ortmodule only the second time)
step rolling-profile 60 bash -c "cd benchmarks && python3 profile_gpu.py --rolling --batch 8 --length 4096 --float32-head"
step rolling-profile-compiled 70 bash -c \
  "cd benchmarks && python3 profile_gpu.py --rolling --batch 8 --length 4096 --float32-head --compiled-normalizers --only ortmodule"
# (2b) the prefill target's shape (32 x 512) with ONNX Runtime's QuickGelu fusion and without it: session 58's
# profiles showed the fused SiLU (`_UnaryElementWise`, bf16) at about a quarter of the bandwidth its bytes
# need, 11% of whole prompts' device time; unfused it is a Sigmoid and a Mul (ortmodule only)
step prefill-profile 40 bash -c "cd benchmarks && python3 profile_gpu.py --batch 32 --length 512 --only ortmodule"
step prefill-profile-no-quickgelu 40 bash -c \
  "cd benchmarks && python3 profile_gpu.py --batch 32 --length 512 --only ortmodule --session-option optimization.disable_specified_optimizers=QuickGeluFusion"
# (3) the normalizers alone on synthetic logits of the workloads' shapes (labelled so), bf16 and float32
step normalizers 75 bash -c "cd benchmarks && python3 log_normalizers.py --compiled && python3 log_normalizers.py --compiled --dtype float32"
# (4) where batch 1's decode step goes without CUDA graphs (session 57: ortmodule about 6 ms a step where
# onnxruntime-genai took 3.7), both, with the kernels a step launches
step decode-profile 45 bash -c "cd benchmarks && python3 profile_gpu.py --decode 64 --batch 1 --length 256"
# (5) the score server at 100 requests/s (1,000 items/s, SGLang's figure at P99 < 500 ms; new in the suite:
# the H200 answered 80 requests/s at P99 477 ms and saturated at 120 in session 58)
suite server 50 "server_load and qwen3 and reuse-auto-100"
# (6) the CUDA tests that did not pass in session 90's run of the whole file with the candidate default on (CUDA
# graphs for a half-precision package's decode steps, runtime.CUDA_GRAPHS_BY_DEFAULT; 57 of 63 passed): the four
# on the real SmolLM2 (not built there: its wheel was not carried), the score's host-read count (0 where 1 was
# expected; the message now says what it saw) and the device-memory count (2.7 GB in use before, 34 MB after:
# earlier tests' garbage, now collected first), and the default's own test; each result in the log as it ends
step cuda-tests 150 python3 -m pytest -v -rs -p no:cacheprovider --cuda-graphs-by-default tests/test_cuda.py -k \
  "real_model or real_bf16 or score_makes_one_copy or memory_growth or cuda_graphs_by_default"
# (7) if the budget has time left: how many patches one run of the vision model should take on CUDA
# (ortmodule/images.py's PATCHES_PER_RUN, 1,024 there as a guess), on Qwen2.5-VL's tower in bf16
step vision-runs 120 python3 benchmarks/vision_runs.py --device cuda
# (8) if time is still left (session 76): lm-eval's image batches encoded ahead of the model against encoded
# in the loop, with the model on the GPU and the processor on the host's cores
step image-host-time 90 python3 benchmarks/image_host_time.py --device cuda --rounds 2
echo "done at $((SECONDS - start)) s" >> "$WORK/plan.log"
pack
