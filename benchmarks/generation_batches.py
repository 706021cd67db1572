"""lm-eval's `generate_until` in batches by their work (ortmodule/lm_eval.py's `in_generation_batches`)
against HFLM's batches of `batch_size` rows, on this CPU, on the real SmolLM2-135M-Instruct fp32
package (the demo's, exported by `python examples/demo.py`), at batch sizes 1 (lm-eval's default), 8
and `auto` (whose HFLM search sizes generation batches for rows of the model's whole context: one row
of SmolLM2's 8,192 tokens). Workloads: the README demo's generation task (40 real questions after two
examples, at most 12 new tokens) and GSM8K-shaped prompts (the same 6 examples, 884 tokens or so in
all, then a question; at most 128 new tokens: benchmarks/kept_beginnings.py's). The two ways run in
turns within one process after a warm-up; per setting the median seconds of `generate_until` and
how many answers are the same text as one request at a time gives. Beside them on the demo's
task, lm-eval's `hf` backend on the same weights (the demo's checkpoint, fp32) at batch sizes 1 and 8,
its answers compared with ortmodule's.

    python benchmarks/generation_batches.py [--package DIR | --int4] [--hf DIR] [--questions 16] [--rounds 3]

`--int4`: the suite's SmolLM2-135M int4 package (ortmodule_dev.fixtures.SMOLLM2_INT4; the `hf` rows stay
fp32), whose answers may differ with the batch (docs/lm-eval.md).
"""

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's dev helpers: ortmodule_dev
from tasks.loaders import Spans, _sentence  # noqa: E402

from ortmodule import lm_eval as backend  # noqa: E402
from ortmodule import shared_prompts  # noqa: E402
from ortmodule_dev import fixtures  # noqa: E402

DEMO = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ortmodule/demo/SmolLM2-135M-Instruct-fp32"
DEMO_HF = DEMO.with_name("SmolLM2-135M-Instruct-hf")
TASK_DIR = Path(backend.__file__).parent / "tasks"
# The backend's method before 2026-12-02: HFLM's loop, its batches of `batch_size` rows.
WAYS = {"HFLM's batches": backend._one_evaluation_at_a_time(shared_prompts.keeping_beginnings(HFLM.generate_until)),
        "by their work": backend.OrtModuleLM.generate_until}


def demo_requests() -> list[Instance]:
    """The demo's `ortmodule_knowledge_gen` requests, as its yaml writes them."""
    shots = ("Question: What is the capital of Peru?\nAnswer: Lima\n\n"
             "Question: How many wheels does a bicycle have?\nAnswer: Two\n\n")
    questions = [json.loads(line)["question"] for line in (TASK_DIR / "knowledge.jsonl").read_text().splitlines()]
    return [Instance("generate_until", None, (f"{shots}Question: {q}\nAnswer:",
                                              {"until": ["\n", "."], "max_gen_toks": 12, "do_sample": False}), i)
            for i, q in enumerate(questions)]


def gsm8k_requests(package: str, questions: int) -> list[Instance]:
    spans = Spans(package, seed=5)  # the package's tokenizer
    examples = "".join(f"Question: {spans(spans.rng.randint(60, 100))}\nAnswer: {_sentence(spans, 30, 60)}\n\n"
                       for _ in range(6))
    return [Instance("generate_until", None, (f"{examples}Question: {spans(spans.rng.randint(40, 100))}\nAnswer:",
                                              {"until": ["Question:", "\n\n"], "max_gen_toks": 128}), i)
            for i in range(questions)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", default=str(DEMO))
    parser.add_argument("--int4", action="store_true", help="the suite's SmolLM2-135M int4 package")
    parser.add_argument("--hf", default=str(DEMO_HF), help="the checkpoint for lm-eval's hf backend")
    parser.add_argument("--questions", type=int, default=16, help="GSM8K-shaped prompts (0: none)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.int4:
        args.package = str(fixtures.build(fixtures.SMOLLM2_INT4).package_dir)
    lms = {size: backend.OrtModuleLM(pretrained=args.package, device="cpu", batch_size=size) for size in (1, 8, "auto")}
    hf = {size: HFLM(pretrained=args.hf, dtype="float32", device="cpu", batch_size=size) for size in (1, 8)}
    for workload, requests in (("demo generation", demo_requests()),
                               ("GSM8K-shaped", gsm8k_requests(args.package, args.questions))):
        if not requests:  # --questions 0: the demo's task alone
            continue
        runs = {(size, name): functools.partial(method, lm)
                for size, lm in lms.items() for name, method in WAYS.items()}
        if workload == "demo generation":  # hf one request at a time takes minutes on the GSM8K-shaped prompts
            runs.update({(size, "hf"): lm.generate_until for size, lm in hf.items()})
        times, answers = {}, {}
        for run in runs.values():
            run(requests[:4], disable_tqdm=True)  # warm-up
        for _ in range(args.rounds):
            for key, run in runs.items():
                start = time.perf_counter()
                answers[key] = run(requests, disable_tqdm=True)
                times.setdefault(key, []).append(time.perf_counter() - start)
        one = answers[1, "HFLM's batches"]
        print(f"{workload}: {len(requests)} requests, median of {args.rounds} rounds")
        for size in lms:
            before, after = (statistics.median(times[size, name]) for name in WAYS)
            same = [sum(a == b for a, b in zip(answers[size, name], one)) for name in WAYS]
            print(f"  batch_size {size}: HFLM's batches {before:.2f} s, by their work {after:.2f} s "
                  f"({before / after:.2f}x); answers as one at a time: {same[0]} and {same[1]} of {len(one)}")
        for size in hf if workload == "demo generation" else ():
            print(f"  hf, batch_size {size}: {statistics.median(times[size, 'hf']):.2f} s; "
                  f"answers as ortmodule's one at a time: {sum(a == b for a, b in zip(answers[size, 'hf'], one))}")


if __name__ == "__main__":
    main()
