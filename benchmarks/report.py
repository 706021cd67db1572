"""Turn pytest-benchmark JSON into the benchmark page: one table per workload, ratios to
transformers on the same weights, the machine, and the command that reproduces it.

    python benchmarks/report.py results.json [more.json ...] > docs/benchmarks.md

benchmarks/run.py runs the suite and this in one command.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict

# Dense bf16 tensor throughput (FLOP/s) of the GPUs the GPU size runs on (SXM parts, no sparsity).
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12}

# What each workload measures; the figures come from the run.
NOTES = {
    "forward": "One forward pass over a batch: logits for every position (`all`) or only the last 4 "
    "(`cont_len`: `cont_len=4` for ortmodule, `logits_to_keep=4` for transformers). "
    "`logits_bytes_per_request` is the logits one row returns; `peak_rss_mb` the process's peak "
    "resident memory during one call.",
    "generate": "Greedy decoding of a left-padded prompt batch; every backend makes all the new tokens "
    "(no early end of sequence). `genai` is onnxruntime-genai's `Generator` on the same package.",
    "lm-eval loglikelihood": "lm-eval multiple-choice task `ortmodule_bench_mc` (benchmarks/tasks: "
    "~200-token contexts; half the questions with ~13-token choices, half with single-token ones), "
    "4 loglikelihood requests per question. `ortmodule` and `transformers` (lm-eval's `hf`) run "
    "batched; lm-eval's `onnxruntime-genai` and `onnxruntime` backends, `genai-stepped` "
    "(onnxruntime-genai's Generator stepped per continuation token, `get_logits()` each step) and "
    "`ort-numpy` (a raw InferenceSession returning full logits to numpy) run batch 1, all they support. "
    "Models load before the clock. `host_bytes_per_request`: model output handed to the host per "
    "request (on a GPU, the device-to-host copy), measured where the backend has one transfer point. "
    "`peak_rss_mb`: the process's peak resident memory during the run, model included.",
    "score": "`ortmodule.score` (SGLang's score API: one query, many short items, 4 labels, softmax) "
    "with the shared-prefix reuse chosen automatically (`auto`) or off (`no_reuse`), beside what a "
    "transformers user writes (the items left-padded in one batch, `logits_to_keep=1`) and "
    "onnxruntime-genai's Generator (one per item, last logits to numpy).",
    "score server": "benchmarks/bench_score.py against `ortmodule serve` in its own process: open-loop "
    "Poisson arrivals at `target_rate` requests/s; latency percentiles of the answered requests.",
}

COMMAND = "python benchmarks/run.py --size {size}"


def case(bench: dict) -> tuple[str, str]:
    """'test_ortmodule_forward[cont_len]' -> ('ortmodule', 'cont_len'); a benchmark that records
    its backend in extra_info (lm-eval's 'hf' is transformers) has no case."""
    if "backend" in bench["extra_info"]:
        backend = bench["extra_info"]["backend"]
        return ("transformers" if backend == "hf" else backend), ""
    match = re.match(r"test_([a-z0-9_]+?)_[a-z]+(?:\[(.*)\])?$", bench["name"])
    return (match.group(1), match.group(2) or "") if match else (bench["name"], "")


def median(bench: dict) -> float | None:
    stats = bench.get("stats") or {}
    return stats.get("median")


def peak_fraction(bench: dict, seconds: float) -> str:
    """2 x parameters x tokens / time, over the device's peak bf16 throughput."""
    info = bench["extra_info"]
    device = info.get("device", "")
    peak = next((flops for name, flops in PEAK_BF16.items() if name in device), None)
    if not peak or not info.get("tokens") or not info.get("parameters") or not seconds:
        return ""
    return f"{100 * 2 * info['parameters'] * info['tokens'] / seconds / peak:.1f}%"


def render(runs: list[dict], size: str) -> str:
    out = []
    machine = runs[0]["machine_info"]
    cpu = machine.get("cpu", {})
    devices = sorted({b["extra_info"].get("device") for r in runs for b in r["benchmarks"]} - {None, "cpu"})
    out.append("# Benchmarks\n")
    out.append(f"Machine: {cpu.get('brand_raw', machine.get('processor'))}, {cpu.get('count', '?')} logical CPUs"
               + (f", GPU: {', '.join(devices)}" if devices else "")
               + f"; Python {machine['python_version']}; run {runs[0]['datetime'][:10]}. "
               "Every row of a table was measured in the same run, so ratios are comparable; "
               "absolute times belong to this machine only.\n")
    out.append(f"Reproduce: `{COMMAND.format(size=size)}` (the suite, then this page).\n")
    groups = defaultdict(list)
    for run in runs:
        for bench in run["benchmarks"]:
            groups[bench["group"]].append(bench)
    for group, benches in groups.items():
        reference = {case(b)[1]: median(b) for b in benches if case(b)[0] == "transformers" and median(b)}
        keys = sorted({k for b in benches for k in b["extra_info"]} - {"backend", "error", "device", "parameters", "tokens"})
        with_fraction = any(peak_fraction(b, median(b) or 0) for b in benches)
        out.append(f"## {group}\n")
        if group in NOTES:
            out.append(NOTES[group] + "\n")
        header = ["backend", "case", "median ms", "speed vs transformers", *keys] + (["of peak bf16"] if with_fraction else [])
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
                base = reference.get(variant, reference.get(""))  # a peer measured once stands for every case
                ratio = f"{base / seconds:.2f}x" if base and seconds else ""
                row = [backend, variant, f"{seconds * 1e3:.1f}" if seconds else "", ratio,
                       *[str(b["extra_info"].get(k, "")) for k in keys]]
            if with_fraction:
                row.append(peak_fraction(b, seconds or 0))
            out.append("| " + " | ".join(row) + " |")
        out.append("")
        for backend, error in errors:
            out.append(f"- `{backend}` failed: `{error}`")
        if errors:
            out.append("")
    out.append(FOOTER)
    return "\n".join(out)


FOOTER = """## How to reproduce, and the GPU table

- CPU (this page): `python benchmarks/run.py --size cpu` runs `pytest benchmarks --benchmark-only
  --bench-size cpu --benchmark-json=benchmarks/results-cpu.json` and writes this page from the JSON
  (benchmarks/report.py). Shapes: benchmarks/conftest.py, size `cpu`: a 50M Llama (hidden 512,
  6 layers, 32,000-token vocabulary) for lm-eval, generate and score, and a 131,072-token
  vocabulary package for the forward workload; fp32, exported by the model builder.
- GPU: on a machine with a CUDA GPU and onnxruntime-gpu, `python benchmarks/run.py --size gpu`
  writes docs/benchmarks-gpu.md the same way. Shapes: Qwen3-0.6B's config and a Gemma-style
  262,144-token vocabulary, random weights, bf16, exported by the model builder for CUDA
  (throughput does not depend on weight values). Its lm-eval table adds the fraction of the GPU's
  peak dense bf16 throughput that scoring reaches: 2 x parameters x tokens / time.
- CI runs every workload once with tiny shapes (`pytest benchmarks --benchmark-disable
  --bench-size smoke`) so the suite never rots; those runs time nothing.
- CPU timings on a small VM vary by about 20% from run to run; compare ratios within one page.
"""


def main(argv: list[str]) -> None:
    size = "cpu"
    if argv[:1] == ["--size"]:
        size, argv = argv[1], argv[2:]
    print(render([json.load(open(p)) for p in argv], size))


if __name__ == "__main__":
    main(sys.argv[1:])
