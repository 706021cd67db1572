"""A sliding-window package on a CPU (Gemma-3-270M's config, random weights, fp32; the suite's
`GEMMA3_270M_CPU`): the two ways ortmodule could run it, timed in turns (median of `--rounds`).

- `--shared` (default): 16 HellaSwag-shaped questions (a 40-120-token context, four continuations
  of 15-40 tokens) scored as padded rows, as shared contexts continued by decode steps (the way
  before the extend graph took sliding windows), and as shared contexts in one extend run.
- `--chunks`: long rows in one prefill against the CPU's chunks of 256 tokens over the row's own
  cache (chunked.py; off for sliding-window packages).

Each way's answers are checked against the first's.

    python benchmarks/sliding_windows.py
    python benchmarks/sliding_windows.py --chunks
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from conftest import GEMMA3_270M_CPU

from ortmodule import OrtModelForCausalLM, scoring
from ortmodule.inputs import pad_right

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's dev helpers: ortmodule_dev
from ortmodule_dev import fixtures  # noqa: E402


def timed(ways: dict, rounds: int) -> None:
    """Run each way once (its answers against the first way's), then `rounds` times in turns."""
    first, *rest = ways
    expected = ways[first]()
    for name in rest:
        print(f"{name}: largest difference from {first}: {(ways[name]() - expected).abs().max().item():.2e}")
    times = {name: [] for name in ways}
    for _ in range(rounds):
        for name, way in ways.items():
            start = time.perf_counter()
            way()
            times[name].append(time.perf_counter() - start)
    for name, seconds in times.items():
        print(f"{name}: median {statistics.median(seconds):.2f} s of {[round(s, 2) for s in seconds]}")


def shared_ways(model) -> dict:
    generator = torch.Generator().manual_seed(0)
    rows, groups, starts, targets = [], [], [], []
    for question in range(16):
        context = torch.randint(4, 30000, (int(torch.randint(40, 120, (1,), generator=generator)),),
                                generator=generator).tolist()
        for _ in range(4):
            rest = torch.randint(4, 30000, (int(torch.randint(15, 40, (1,), generator=generator)),),
                                 generator=generator).tolist()
            rows.append((context + rest)[:-1])
            groups.append(question)
            starts.append(len(context) - 1)
            targets.append(rest)
    ids, mask = pad_right(rows)
    extender = model.decoder.extender
    if extender() is None:
        raise SystemExit("ortmodule made no extend graph for this package (its log says why)")

    def shared() -> torch.Tensor:
        return scoring.grouped_loglikelihood_totals(model, rows, groups, starts, targets)[0]

    def steps() -> torch.Tensor:
        model.decoder.extender = lambda: None  # the decode steps, as without an extend graph
        try:
            return shared()
        finally:
            model.decoder.extender = extender

    return {"padded rows": lambda: scoring.loglikelihood_totals(model, ids, mask, starts, targets)[0],
            "shared, decode steps": steps, "shared, extend graph": shared}


def chunk_ways(package_dir) -> dict:
    whole = OrtModelForCausalLM.from_pretrained(package_dir, prefill_chunk=0)
    chunked = OrtModelForCausalLM.from_pretrained(package_dir, prefill_chunk=256)
    generator = torch.Generator().manual_seed(0)
    ways = {}
    for label, (rows, width, keep) in {"1 x 2048, every position": (1, 2048, None), "4 x 1024, last 4": (4, 1024, 4),
                                       "8 x 640, last 1": (8, 640, 1)}.items():
        ids = torch.randint(4, 30000, (rows, width), generator=generator)
        for name, model in (("one prefill", whole), ("chunks of 256", chunked)):
            ways[f"{label}, {name}"] = (lambda m, i, k: lambda: m(i, cont_len=k).logits)(model, ids, keep)
    return ways


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", action="store_true", help="long rows: one prefill against chunks")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    fixture = fixtures.build(GEMMA3_270M_CPU)
    print(f"Gemma-3-270M's config, random weights, fp32, {torch.get_num_threads()} threads")
    with torch.no_grad():
        if args.chunks:
            ways = chunk_ways(fixture.package_dir)
            for label in ("1 x 2048, every position", "4 x 1024, last 4", "8 x 640, last 1"):
                timed({name: way for name, way in ways.items() if name.startswith(label)}, args.rounds)
        else:
            timed(shared_ways(OrtModelForCausalLM.from_pretrained(fixture.package_dir)), args.rounds)


if __name__ == "__main__":
    main()
