"""`ortmodule.score` with a long query shared by its items, and the peak memory of a long prompt's
log-probabilities (the server's echo / `prompt_logprobs` path): docs/measurements.md, session 98. On the
demo's real SmolLM2-135M fp32 package (`python examples/demo.py` makes it), random token ids, items of 5
tokens, two labels, softmax; each query length and item count with the reuse chosen from the measured costs
(`auto`), on and off; then one prompt's log-probabilities, ranks and top 5 (`--prompt N` tokens) and the
process's peak RSS. Run each part in its own process:

    python benchmarks/long_query_score.py
    python benchmarks/long_query_score.py --prompt 6000
"""

import argparse
import random
import resource
import time
from pathlib import Path

import ortmodule
from ortmodule.serving import jobs

PACKAGE = Path.home() / ".cache/ortmodule/demo/SmolLM2-135M-Instruct-fp32"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", default=str(PACKAGE))
    parser.add_argument("--prompt", type=int, default=0, help="a prompt of this many tokens' log-probabilities")
    args = parser.parse_args()
    model = ortmodule.OrtModelForCausalLM.from_pretrained(args.package)
    model.measured_costs()
    rng = random.Random(0)
    if args.prompt:
        prompt = [rng.randrange(100, 40000) for _ in range(args.prompt)]
        start = time.perf_counter()
        jobs.prompt_scores(model, [prompt], 5, ranked=True)
        print(f"{args.prompt}-token prompt: {time.perf_counter() - start:.1f} s, peak RSS "
              f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MB")
        return
    for length, count in ((500, 16), (500, 64), (2000, 16), (2000, 64)):
        query = [rng.randrange(100, 40000) for _ in range(length)]
        items = [[rng.randrange(100, 40000) for _ in range(5)] for _ in range(count)]
        for reuse in (None, True, False):
            start = time.perf_counter()
            ortmodule.score(model, None, query, items, [9, 17], apply_softmax=True, reuse_prefix=reuse)
            print(f"query {length}, {count} items, reuse_prefix={reuse}: {time.perf_counter() - start:.2f} s",
                  flush=True)


if __name__ == "__main__":
    main()
