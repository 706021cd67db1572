#!/usr/bin/env bash
# The GPU run after the targets run (planned in session 92, docs/measurements.md "The next decisions
# run"): what session 92's decisions run did not finish, and the first checks of its new default
# (runtime.CUDA_GRAPHS_BY_DEFAULT, on since session 92). From the project's root on a machine with a
# CUDA GPU, onnxruntime-gpu and the project's dependencies importable (PYTHONPATH as the caller set it),
# `bash benchmarks/next_gpu_run.sh`.
# Each step runs under its own deadline inside BUDGET seconds (default 570), so that what finished
# comes back when a later step runs long; everything comes back in $OUT/run.tgz (gpu_run_lib.sh).
# tests/test_benchmark_pages.py checks that every selection here still collects.
WORK=${WORK:-/tmp/next-gpu-run}
source "$(dirname "$0")/gpu_run_lib.sh"

# (0) the Qwen3-0.6B-shaped bf16 package, exported before the steps that time it (about 75 s on session
# 92's fresh machine, the real SmolLM2's conversion included)
step package 90 bash -c "cd benchmarks && python3 -c 'from conftest import QWEN3_0_6B; from ortmodule_dev import fixtures; print(fixtures.build(QWEN3_0_6B).package_dir)'"
# (1) the whole CUDA test file with CUDA graphs on by default, as it now is (it passed in parts: 57
# tests in session 90, six in session 92, the thread test and the score's host-read count, both fixed
# since, in session 93); about 110 s in session 90. (The server at 100 requests/s, planned here, ran in
# session 93's targets run: 987 items/s at P99 204 ms.)
step cuda-tests 200 python3 -m pytest -v -rs -p no:cacheprovider tests/test_cuda.py
# (2) batch 1's decode step with the new default (CUDA graphs: one launch a step) beside onnxruntime-genai's
# Generator (session 92 without them: 4.38 ms a step against the Generator's 5.61, both paced by the host)
step decode-profile 45 bash -c "cd benchmarks && python3 profile_gpu.py --decode 64 --batch 1 --length 256"
# (3) how many patches one run of the vision model should take on CUDA (ortmodule/images.py's
# PATCHES_PER_RUN, 1,024 there as a guess), on Qwen2.5-VL's tower in bf16 (session 92: 53 s were too few)
step vision-runs 120 python3 benchmarks/vision_runs.py --device cuda
# (4) if time is left (session 76): lm-eval's image batches encoded ahead of the model against encoded
# in the loop, with the model on the GPU and the processor on the host's cores
step image-host-time 90 python3 benchmarks/image_host_time.py --device cuda --rounds 2
echo "done at $((SECONDS - start)) s" >> "$WORK/plan.log"
pack
