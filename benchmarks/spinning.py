"""ONNX Runtime's intra-op workers between the parallel sections of a run, on this CPU: spinning
within a run and stopped when it returns (`runtime.SPINNING`, ortmodule's sessions since session
39) against never spinning (`session.intra_op.allow_spinning=0`, ortmodule's sessions before) and
against spinning between runs too (ONNX Runtime's default). Three models of the same package in
one process, timed in turns (the best of `--repeats` rounds):
greedy and sampled `generate` of 32 new tokens after 100-token prompts at batch 1 and 8, and a
scoring forward of 16 x 200 tokens (`cont_len=4`), on the real SmolLM2-135M packages (fp32, int4).
With `--server`: `ortmodule serve` on the fp32 package each way, in turns (`--repeats` rounds of
each), under 4 score requests/s for 20 s (a 60-token query, 4 items of 40 tokens, 2 labels;
bench_score.py): latency percentiles and items/s.

    python benchmarks/spinning.py
    python benchmarks/spinning.py --server --repeats 2
"""

import argparse
import platform
import sys
from pathlib import Path

import torch

from ortmodule import OrtModelForCausalLM, runtime
from ortmodule.costs import _best_times

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's dev helpers: ortmodule_dev
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_score, beside this file
from ortmodule_dev import fixtures  # noqa: E402

NEVER = (("session.intra_op.allow_spinning", "0"),)
ALWAYS = (("session.intra_op.allow_spinning", "1"),)  # ONNX Runtime's default: spinning between runs too


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


def servers(repeats: int) -> None:
    """The score server each way, in turns."""
    import asyncio

    from bench_score import LocalServer, make_requests, run_load

    spec = fixtures.SMOLLM2
    package = fixtures.build(spec).package_dir
    bodies = list(make_requests(250, spec.vocab_size, 60, 4, 40, 2, seed=1, exact=True))
    print("| workers | P50 ms | P99 ms | items/s | requests answered |")
    print("|---|---|---|---|---|")
    for _ in range(repeats):
        for label, launcher in (("spinning within a run (now)", []),
                                ("never spinning (before)", [sys.executable, __file__, "--serve-never-spinning"])):
            server = LocalServer(package, "cpu", [], launcher)
            try:
                result = asyncio.run(run_load(server.url, 4, 20, bodies))
            finally:
                server.close()
            print(f"| {label} | {result['p50_ms']} | {result['p99_ms']} | {result['items_per_s']} | "
                  f"{result['ok']} of {result['sent']} |", flush=True)


def main() -> None:
    if sys.argv[1:2] == ["--serve-never-spinning"]:  # the server's process: `ortmodule ...` with the old setting
        from ortmodule import cli

        runtime.SPINNING = NEVER
        cli.ortmodule(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--server", action="store_true", help="the score server each way instead")
    args = parser.parse_args()
    if args.server:
        print(f"{cpu_name()}; `ortmodule serve` on the fp32 package, in turns\n")
        servers(args.repeats)
        return
    print(f"{cpu_name()}, {torch.get_num_threads()} threads; ms, best of {args.repeats} rounds in turns\n")
    print("| package | workload | spinning within a run (now) | never spinning (before) | spinning between runs "
          "too | before / now | between runs too / now |")
    print("|---|---|---|---|---|---|---|")
    for name, spec in (("fp32", fixtures.SMOLLM2), ("int4", fixtures.SMOLLM2_INT4)):
        package = fixtures.build(spec).package_dir
        ways = [workloads(load(package, spinning)) for spinning in (runtime.SPINNING, NEVER, ALWAYS)]
        for label in ways[0]:
            now, before, always = _best_times([way[label] for way in ways], torch.device("cpu"), args.repeats)
            print(f"| {name} | {label} | {1e3 * now:.0f} | {1e3 * before:.0f} | {1e3 * always:.0f} | "
                  f"{before / now:.2f}x | {always / now:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
