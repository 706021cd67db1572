"""`ortmodule.score`'s first calls in a fresh cache folder, on the real SmolLM2-135M fp32 package:
what each call takes, and after which one the model's costs are timed (`scoring.prefix_reuse`:
token counts decide until the model's calls have held `scoring.UNTIMED_TOKENS` tokens).

A call of three one-token items after a short text query, then `--calls` calls of SGLang's score
shape (a 120-token query and 10 items of 180 random token ids), each timed, in a process whose
`ORTMODULE_CACHE` is a new folder (no rewritten graphs, no kept costs), on the CPU.

    python benchmarks/first_score.py
    python benchmarks/first_score.py --calls 10
"""

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's dev helpers: ortmodule_dev
from ortmodule_dev import fixtures  # noqa: E402


def run_calls(package: str, count: int) -> None:
    import ortmodule

    model = ortmodule.OrtModelForCausalLM.from_pretrained(package, device="cpu")
    tokenizer = ortmodule.load_tokenizer(package)
    labels = tokenizer.encode(" yes") + tokenizer.encode(" no")

    def timed(name: str, *args) -> None:
        start = time.perf_counter()
        ortmodule.score(model, *args, labels)
        seconds = time.perf_counter() - start
        costs = "yes" if model.measured_costs(measure=False) is not None else "no"
        print(f"| {name} | {seconds:.2f} | {costs} |", flush=True)

    timed("3 one-token items after a text query", tokenizer,
          "Is this review positive? Review: I loved this film, the acting was wonderful. Answer:",
          [" positive", " negative", " neutral"])
    rng = random.Random(0)
    for k in range(count):
        query = [rng.randrange(4, 49000) for _ in range(120)]
        items = [[rng.randrange(4, 49000) for _ in range(180)] for _ in range(10)]
        timed(f"SGLang's shape, call {k + 1}", None, query, items)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--one", metavar="PACKAGE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        run_calls(args.one, args.calls)
        return
    package = fixtures.build(fixtures.SMOLLM2).package_dir  # in the usual cache folder, before the fresh one
    print("| call | seconds | the model has its costs after it |")
    print("|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "ORTMODULE_CACHE": folder, "TQDM_DISABLE": "1"}
        subprocess.run([sys.executable, __file__, "--one", str(package), "--calls", str(args.calls)], env=env,
                       check=True)


if __name__ == "__main__":
    main()
