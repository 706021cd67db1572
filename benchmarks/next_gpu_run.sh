#!/usr/bin/env bash
# The decisions run of issue 26, as docs/measurements.md plans it ("The decisions run", in the GPU
# session after the targets run, benchmarks/targets_gpu_run.sh): from the project's root on a
# machine with a CUDA GPU, onnxruntime-gpu and the project's dependencies importable (PYTHONPATH as
# the caller set it), `bash benchmarks/next_gpu_run.sh`.
# Each step runs under its own deadline inside BUDGET seconds (default 570), so that what finished
# comes back when a later step runs long; everything comes back in $OUT/run.tgz (gpu_run_lib.sh).
# tests/test_benchmark_pages.py checks that every selection here still collects.
WORK=/tmp/next-gpu-run
source "$(dirname "$0")/gpu_run_lib.sh"

fastest_query_once() {  # the extend graph under which step (2) ran each query once fastest: LAYOUT,HEADS
  python3 - "$WORK" <<'PY'
import pathlib, re, sys
ways = {"score-repeat": "mask,repeated", "score-grouped": "mask,grouped", "score-cache-grouped": "cache,grouped"}
times = {}
for log, way in ways.items():
    path = pathlib.Path(sys.argv[1]) / f"{log}.log"
    found = path.is_file() and re.search(r"^== query once \(reuse on\): ([0-9.]+) ms", path.read_text(), re.M)
    if found:
        times[way] = float(found.group(1))
print(min(times, key=times.get) if times else "mask,repeated")
PY
}

# (0) the Qwen3-0.6B-shaped bf16 package, exported before the steps that time it: its export (~25 s)
# inside step (2)'s 40 s would leave the first profile cut short (a fixture is kept only when whole)
step package 120 bash -c "cd benchmarks && python3 -c 'from conftest import QWEN3_0_6B; from ortmodule_dev import fixtures; print(fixtures.build(QWEN3_0_6B).package_dir)'"
# (1) the CUDA tests that failed in session 36 (fixed without a GPU): a device without an index,
# and Gemma 3's windowed KV buffers (graph.unbounded_window_caches), its cache and generate past the window;
# and session 37's: a dropped model's device memory back at once (no reference cycle); and session 38's:
# the scoring paths queue their work without waiting for the device (no blocking copy up); and session 41's:
# measured costs kept on disk, read back at a second load (its check prefill within 1.5x on a GPU); and
# session 45's: hidden states and inputs_embeds (second sessions of the graph) on the device; and session 56's:
# a hybrid's (LFM2's) cache cropped and continued on the device
step cuda-tests 150 python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py -k \
  "unpacked_projections or shared_contexts_extend_sliding or sliding_window_cache or dropped_model or queue_their_work or costs_are_kept or hidden_states_on_cuda or inputs_embeds_on_cuda or images_on_cuda or hybrid_crops_on_cuda"
# (2) the score server's call at SGLang's shape, each prompt whole and each query run once, with the
# extend graph's KV heads repeated (the default on CUDA), grouped (extend.REPEAT_KV_HEADS_ON_CUDA),
# and grouped in the cache layout (flash attention over the rows' caches, extend.EXTEND_LAYOUT)
step score-repeat 40 bash -c "cd benchmarks && python3 profile_gpu.py --score 10"
step score-grouped 40 bash -c "cd benchmarks && python3 profile_gpu.py --score 10 --grouped-kv"
step score-cache-grouped 40 bash -c "cd benchmarks && python3 profile_gpu.py --score 10 --grouped-kv --extend-layout cache"
# (3) the score server at SGLang's shape, to 160 requests/s, with the model thread's time per group
# and the share of requests whose query ran once, as the measured costs choose (auto); then every
# query run once (--reuse-prefix on) at 120 and 160 requests/s, in the extend graph that ran (2)'s
# queries once fastest (benchmarks/serve_with_extend.py; the rows record it as `extend_graph`)
suite server 170 "server_load and qwen3 and reuse-auto"
extend_graph=$(fastest_query_once)
echo "server-reuse: the extend graph $extend_graph" >> "$WORK/plan.log"
suite server-reuse 90 "server_load and qwen3 and reuse-on" --server-extend "$extend_graph"
# (4) where a rolling batch's device time goes (8 windows of 4,096, every position scored, as the lm-eval
# backend scores them), against transformers: the rolling target is short and device-bound, never profiled
step rolling-profile 60 bash -c "cd benchmarks && python3 profile_gpu.py --rolling --batch 8 --length 4096"
# (5) lm-eval's shared contexts (HellaSwag-shaped groups) the same three ways
step extend-repeat 40 bash -c "cd benchmarks && python3 profile_gpu.py --shared --batch 64 --length 80"
step extend-grouped 40 bash -c "cd benchmarks && python3 profile_gpu.py --shared --batch 64 --length 80 --grouped-kv"
step extend-cache-grouped 40 bash -c \
  "cd benchmarks && python3 profile_gpu.py --shared --batch 64 --length 80 --grouped-kv --extend-layout cache"
# (6) where batch 1's decode step goes without CUDA graphs (session 57: ortmodule about 6 ms a step where
# onnxruntime-genai took 3.7), both, with the kernels a step launches (rolling on SmolLM2's tokenizer, step 6
# until session 57, ran in session 57's targets run)
step decode-profile 45 bash -c "cd benchmarks && python3 profile_gpu.py --decode 64 --batch 1 --length 256"
# (7) if the budget has time left: how many patches one run of the vision model should take on CUDA
# (ortmodule/images.py's PATCHES_PER_RUN, 1,024 there as a guess): frame by frame, 1,024, 4,096 and every
# image in one run, beside transformers' vision tower, on Qwen2.5-VL's tower in bf16 (its export ~1 minute)
step vision-runs 120 python3 benchmarks/vision_runs.py --device cuda
echo "done at $((SECONDS - start)) s" >> "$WORK/plan.log"
pack
