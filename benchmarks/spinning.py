"""ONNX Runtime's intra-op workers between the parallel sections of a run, on this CPU: spinning
within a run and stopped when it returns (`runtime.SPINNING`, ortmodule's sessions since session
39) against never spinning (`session.intra_op.allow_spinning=0`, ortmodule's sessions before).
Two models of the same package in one process, timed in turns (the best of `--repeats` rounds):
greedy and sampled `generate` of 32 new tokens after 100-token prompts at batch 1 and 8, and a
scoring forward of 16 x 200 tokens (`cont_len=4`), on the real SmolLM2-135M packages (fp32, int4).

    python benchmarks/spinning.py
"""

import argparse
import platform
import sys
from pathlib import Path

import torch

from ortmodule import OrtModelForCausalLM, runtime
from ortmodule.costs import _best_times

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's dev helpers: ortmodule_dev
from ortmodule_dev import fixtures  # noqa: E402

NEVER = (("session.intra_op.allow_spinning", "0"),)


def cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def load(package: Path, spinning) -> OrtModelForCausalLM:
    default, runtime.SPINNING = runtime.SPINNING, spinning  # read by runtime.make_session at load
    try:
        return OrtModelForCausalLM.from_pretrained(package)
    finally:
        runtime.SPINNING = default


def workloads(model: OrtModelForCausalLM) -> dict:
    generator = torch.Generator().manual_seed(0)
    out = {}
    for rows in (1, 8):
        ids = torch.randint(4, 49000, (rows, 100), generator=generator)
        for sampled in (False, True):
            settings = dict(max_new_tokens=32, min_new_tokens=32, do_sample=sampled)
            if sampled:
                settings.update(top_p=0.9, temperature=0.7)
            out[f"generate batch {rows}, {'sampled' if sampled else 'greedy'}"] = (
                lambda ids=ids, s=settings: model.generate(ids, attention_mask=torch.ones_like(ids), **s))
    scored = torch.randint(4, 49000, (16, 200), generator=generator)
    out["forward 16 x 200, cont_len=4"] = lambda: model(scored, cont_len=4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"{cpu_name()}, {torch.get_num_threads()} threads; ms, best of {args.repeats} rounds in turns\n")
    print("| package | workload | spinning within a run (now) | never spinning (before) | before / now |")
    print("|---|---|---|---|---|")
    for name, spec in (("fp32", fixtures.SMOLLM2), ("int4", fixtures.SMOLLM2_INT4)):
        package = fixtures.build(spec).package_dir
        now, before = workloads(load(package, runtime.SPINNING)), workloads(load(package, NEVER))
        for label in now:
            fast, slow = _best_times([now[label], before[label]], torch.device("cpu"), args.repeats)
            print(f"| {name} | {label} | {1e3 * fast:.0f} | {1e3 * slow:.0f} | {slow / fast:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
