"""The process's memory after the costs are timed (`costs.measure`, what `share_contexts=auto`, `ortmodule
serve` and `score` after 16,384 tokens decide from) against the same work without the timing: ONNX Runtime's
CPU arena keeps what a session's largest run took until the session goes, and the timing's extend probes run
over 2,048 cached positions a row (docs/measurements.md, session 96). Loads the real SmolLM2-135M fp32
package, times its costs (`--timed`) or only makes its extend session, then runs six `score` calls that run
their query once (a 200-token query, 16 items of 30 tokens) and prints the resident memory after each step,
and after glibc's `malloc_trim` (what the C heap keeps but no longer uses). Run each way in its own process:

    python benchmarks/costs_memory.py
    python benchmarks/costs_memory.py --timed
"""

import argparse
import ctypes
import sys
from pathlib import Path

import psutil
import torch

import ortmodule

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's dev helpers: ortmodule_dev
from ortmodule_dev import fixtures  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timed", action="store_true", help="time the costs (again) first")
    args = parser.parse_args()
    process = psutil.Process()

    def rss(what: str) -> None:
        print(f"{what}: {process.memory_info().rss >> 20} MB")

    model = ortmodule.OrtModelForCausalLM.from_pretrained(fixtures.build(fixtures.SMOLLM2).package_dir)
    rss("loaded")
    if args.timed:
        model.measured_costs(refresh=True)
        rss("costs timed")
    else:
        model.decoder.extender()
        rss("extend session made")
    generator = torch.Generator().manual_seed(0)
    for _ in range(6):
        query = torch.randint(10, 40000, (200,), generator=generator).tolist()
        items = [torch.randint(10, 40000, (30,), generator=generator).tolist() for _ in range(16)]
        ortmodule.score(model, None, query, items, [1, 2], reuse_prefix=True)
    rss("after six score calls")
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    rss("after malloc_trim")


if __name__ == "__main__":
    main()
