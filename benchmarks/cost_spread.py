"""How far apart repeated measurements of a model's costs land (`costs.measure`, what
`share_contexts=auto` and `ortmodule serve --reuse-prefix auto` decide from): the costs are kept
on disk for later processes (kept_costs.py), so one noisy reading lasts until a later check
finds the machine 1.5x faster or slower. Measures the costs of the real SmolLM2-135M fp32 package
(or, with `--model qwen3-0.6b`, Qwen3-0.6B's shape in fp32) `--times` times in one process, one
after another, and prints each measurement with its seconds and the price ratio of the decision
these costs weigh most finely (two documents of 3,001 and 2,501 tokens that share their first token,
lm-eval's rolling shape: shared over one prefill, `sharing.worth_sharing`; above 1 keeps them whole,
which is right on a CPU, where sharing runs ~1.5x slower: docs/measurements.md, sessions 52-54),
then per cost its smallest and largest reading and their ratio (the spread).

    python benchmarks/cost_spread.py --times 8
    python benchmarks/cost_spread.py --model qwen3-0.6b --times 1
"""

import argparse
import sys
import time
from pathlib import Path

import torch

from ortmodule import OrtModelForCausalLM, costs, sharing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's dev helpers: ortmodule_dev
from ortmodule_dev import fixtures  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--times", type=int, default=5, help="measurements (default 5)")
    parser.add_argument("--model", choices=("smollm2", "qwen3-0.6b"), default="smollm2")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    cpu = args.device == "cpu"
    if args.model == "qwen3-0.6b":
        from conftest import QWEN3_0_6B, QWEN3_0_6B_CPU  # the benchmark suite's Qwen3 shapes

        spec = QWEN3_0_6B_CPU if cpu else QWEN3_0_6B
    else:
        spec = fixtures.SMOLLM2 if cpu else fixtures.SMOLLM2_BF16_CUDA
    model = OrtModelForCausalLM.from_pretrained(fixtures.build(spec).package_dir, device=args.device)
    readings = []
    for i in range(args.times):
        start = time.perf_counter()
        readings.append(costs.measure(model.decoder))
        shown = {k: f"{v:.3g}" if isinstance(v, float) else v for k, v in readings[-1]._asdict().items()}
        print(f"measurement {i + 1}: {time.perf_counter() - start:.1f} s, long documents shared / whole "
              f"{long_documents(readings[-1]):.2f}, {shown}", flush=True)
    print("| cost | smallest | largest | spread |")
    print("|---|---|---|---|")
    for field in costs.Costs._fields:
        values = [getattr(r, field) for r in readings]
        if not all(isinstance(v, float) for v in values):
            continue
        positive = [v for v in values if v > 0]
        spread = f"{max(positive) / min(positive):.2f}x" if positive else ""
        zeros = f" ({len(values) - len(positive)} of {len(values)} readings 0)" if len(positive) < len(values) else ""
        print(f"| {field} | {min(values):.3g} | {max(values):.3g} | {spread}{zeros} |")


def long_documents(measured: costs.Costs) -> float:
    """Two documents of 3,001 and 2,501 tokens sharing their first token, lm-eval's batch of 8 rows:
    their price shared over their price in one prefill (`sharing.sharing_prices`)."""
    generator = torch.Generator().manual_seed(4)
    rows = [[0] + torch.randint(10, 40000, (n,), generator=generator).tolist() for n in (3000, 2500)]
    shared, whole = sharing.sharing_prices(rows, [0, 0], measured, 8)
    return shared / whole


if __name__ == "__main__":
    main()
