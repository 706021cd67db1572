"""How many shared contexts and padded rows an lm-eval batch of a fixed batch size holds
(ortmodule/lm_eval.py's `group_batches`, `fixed_batch_end` and `SMALL_WORK`), on this CPU, on the real
SmolLM2-135M-Instruct fp32 package, at batch size 8 and at lm-eval's default of 1: batches counted by
their rows alone (`SMALL_WORK` 0, as before session 73: a question with four choices is four rows, so a
batch of 8 held two questions), and filled by their work up to 512 tokens (the default) and up to 2,048.
Workloads: the README demo's multiple-choice task (40 short real questions) and the suite's ARC- and
HellaSwag-shaped ones (16 questions each, benchmarks/tasks). The settings run in turns within one
process, 5 rounds after a warm-up; per setting the median seconds inside the backend's `loglikelihood`
calls, the ONNX Runtime runs they made, and how far their log-likelihoods are from the rows-only ones.

    python benchmarks/shared_batches.py
"""

import functools
import itertools
import statistics
import sys
import time
from pathlib import Path

import lm_eval
from lm_eval.api.registry import get_model
from lm_eval.tasks import TaskManager

import ortmodule.lm_eval
from ortmodule import runtime, tasks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's dev helpers: ortmodule_dev
from evaluation import TASK_DIR  # noqa: E402

from ortmodule_dev import fixtures  # noqa: E402

SETTINGS = {"rows only": 0, "work up to 512": 512, "work up to 2048": 2048}  # SMALL_WORK
ROUNDS = 5
BATCH_SIZES = (8, 1)


def workloads(fixture):
    """(name, task, task manager, limit)."""
    suite = TaskManager(include_path=TASK_DIR, include_defaults=False, metadata={"tokenizer": str(fixture.hf_dir)})
    return [("demo multiple choice", "ortmodule_knowledge_mc", tasks.task_manager(["ortmodule_knowledge_mc"]), None),
            ("arc", "ortmodule_bench_arc", suite, 16), ("hellaswag", "ortmodule_bench_hellaswag", suite, 16)]


def counted(lm, spent: list) -> None:
    """`lm.loglikelihood` with a clock into `spent[0]`, and ONNX Runtime's runs counted into `spent[1]`."""
    call, run = lm.loglikelihood, runtime.Session.run

    def clocked(requests, *args, **kwargs):
        start = time.perf_counter()
        try:
            return call(requests, *args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    @functools.wraps(run)
    def counting(self, *args, **kwargs):
        spent[1] += 1
        return run(self, *args, **kwargs)

    lm.loglikelihood, runtime.Session.run = clocked, counting


def evaluate(lm, task, manager, limit, spent) -> tuple[float, int, list[float]]:
    """One evaluation: seconds in the backend, runs, and every request's log-likelihood."""
    before = list(spent)
    result = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=manager, limit=limit, verbosity="ERROR",
                                     log_samples=True)
    answers = [float(resp[0][0]) for sample in result["samples"][task] for resp in sample["resps"]]
    return spent[0] - before[0], spent[1] - before[1], answers


def main() -> None:
    fixture = fixtures.build(fixtures.SMOLLM2)
    print("| batch size | workload | batches | median s | runs | speed vs rows only | max log-likelihood diff |")
    print("|---|---|---|---|---|---|---|")
    lm = get_model("ortmodule")(pretrained=str(fixture.package_dir), device="cpu", batch_size=BATCH_SIZES[0])
    spent = [0.0, 0]
    counted(lm, spent)
    for batch_size, (name, task, manager, limit) in itertools.product(BATCH_SIZES, workloads(fixture)):
        lm.batch_size_per_gpu = batch_size  # HFLM's `batch_size`, read at each call
        times = {setting: [] for setting in SETTINGS}
        runs, answers = {}, {}
        for round in range(ROUNDS + 1):  # round 0 warms up
            for setting, work in SETTINGS.items():
                ortmodule.lm_eval.SMALL_WORK = work
                seconds, runs[setting], answers[setting] = evaluate(lm, task, manager, limit, spent)
                if round:
                    times[setting].append(seconds)
        base = statistics.median(times["rows only"])
        for setting in SETTINGS:
            median = statistics.median(times[setting])
            diff = max(abs(a - b) for a, b in zip(answers[setting], answers["rows only"]))
            print(f"| {batch_size} | {name} | {setting} | {median:.2f} | {runs[setting]} | {base / median:.2f}x "
                  f"| {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
