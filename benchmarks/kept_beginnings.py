"""A few-shot generation task's examples run once for all its batches, on a CPU: lm-eval's
`generate_until` on prompts that all begin with the same examples (GSM8K's chain-of-thought and
BIG-Bench Hard's tasks give every question the same fixed examples), with the examples kept between
batches (`shared_prompts.keeping`, the backend's default) and run once a batch (as before 2026-12-01),
alternately; the real SmolLM2-135M-Instruct fp32 package (the demo's, exported by `python
examples/demo.py`). The figures of docs/measurements.md's session 70.

    python benchmarks/kept_beginnings.py [--package DIR] [--questions 32] [--rounds 2]
"""

import argparse
import os
import sys
import time
from pathlib import Path

from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's dev helpers: ortmodule_dev
from tasks.loaders import Spans, _sentence  # noqa: E402

from ortmodule import lm_eval as backend  # noqa: E402

DEMO = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ortmodule/demo/SmolLM2-135M-Instruct-fp32"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", default=str(DEMO))
    parser.add_argument("--questions", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    lm = backend.OrtModuleLM(pretrained=args.package, device="cpu", batch_size=8)
    spans = Spans(args.package, seed=5)  # the package's tokenizer
    examples = "".join(f"Question: {spans(spans.rng.randint(60, 100))}\nAnswer: {_sentence(spans, 30, 60)}\n\n"
                       for _ in range(6))
    requests = [Instance("generate_until", None, (f"{examples}Question: {spans(spans.rng.randint(40, 100))}\nAnswer:",
                                                  {"until": ["Question:", "\n\n"], "max_gen_toks": 128}), i)
                for i in range(args.questions)]
    print(f"{args.questions} prompts of {len(lm.tok_encode(requests[0].args[0]))} tokens or so, "
          f"{len(lm.tok_encode(examples))} of them the same examples; batch 8, at most 128 new tokens")
    ways = {"kept between batches": type(lm).generate_until,
            "once a batch": backend._one_evaluation_at_a_time(HFLM.generate_until)}
    lm.generate_until(requests[:8], disable_tqdm=True)  # warm-up
    answers = {}
    for _ in range(args.rounds):
        for name, method in ways.items():
            start = time.perf_counter()
            answers[name] = method(lm, requests, disable_tqdm=True)
            print(f"{name}: {time.perf_counter() - start:.2f} s")
    print("the same answers:", len({tuple(a) for a in answers.values()}) == 1)


if __name__ == "__main__":
    main()
