"""One subject of MMLU as lm-eval runs it 5-shot (the suite's `fewshot` task: 250 questions whose prompts
all begin with the same description and five examples, four one-token letters), through lm-eval's
backends on the real SmolLM2-135M-Instruct fp32 package on a CPU (the demo's, exported by `python
examples/demo.py`): ortmodule with the examples run once for the subject (its default,
`sharing.KeptPrefixes`), ortmodule with them run once a batch (as before 2026-12-01), alternately, and
lm-eval's `hf` on the same weights; batch 8. Per way: the time inside the backend's `loglikelihood`,
the part of it in the decoder's prefills and in the extend runs (ortmodule), and the answers against
`hf`'s. The figures of docs/measurements.md's session 70.

    python benchmarks/fewshot_subject.py [--questions 250] [--rounds 2] [--no-hf]
"""

import argparse
import collections
import os
import sys
import time
from pathlib import Path
from unittest import mock

import lm_eval
from lm_eval.api.registry import get_model
from lm_eval.tasks import TaskManager

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's dev helpers: ortmodule_dev
import ortmodule.lm_eval  # noqa: E402,F401  (registers the backend)
from ortmodule import decoder, extend, sharing  # noqa: E402

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ortmodule/demo"
TASK = "ortmodule_bench_fewshot"


def evaluate(lm, tasks, questions: int) -> tuple[float, dict, list]:
    """The seconds inside `lm.loglikelihood`, the seconds in each clocked part (outermost calls only: a
    long prefill runs its first chunk as a prefill of its own), and every request's loglikelihood."""
    clock, depth = collections.defaultdict(float), collections.Counter()

    def clocked(name, method):
        def run(*args, **kwargs):
            start, depth[name] = time.perf_counter(), depth[name] + 1
            try:
                return method(*args, **kwargs)
            finally:
                depth[name] -= 1
                if not depth[name]:
                    clock[name] += time.perf_counter() - start
        return run

    with mock.patch.object(type(lm), "loglikelihood", clocked("loglikelihood", type(lm).loglikelihood)), \
            mock.patch.object(decoder.Decoder, "prefill", clocked("prefills", decoder.Decoder.prefill)), \
            mock.patch.object(extend.Extender, "run", clocked("extend runs", extend.Extender.run)):
        result = lm_eval.simple_evaluate(model=lm, tasks=[TASK], task_manager=tasks, limit=questions,
                                         verbosity="ERROR", log_samples=True)
    answers = [float(resp[0][0]) for sample in result["samples"][TASK] for resp in sample["resps"]]
    return clock.pop("loglikelihood"), dict(clock), answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=250)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-hf", action="store_true", help="leave lm-eval's hf backend out")
    args = parser.parse_args()
    package, checkpoint = CACHE / "SmolLM2-135M-Instruct-fp32", CACHE / "SmolLM2-135M-Instruct-hf"
    tasks = TaskManager(include_path=str(Path(__file__).parent / "tasks"), include_defaults=False,
                        metadata={"tokenizer": str(checkpoint)})
    ours = get_model("ortmodule")(pretrained=str(package), device="cpu", batch_size=8)
    lm_eval.simple_evaluate(model=ours, tasks=[TASK], task_manager=tasks, limit=2, verbosity="ERROR")  # warm-up
    print(f"{args.questions} questions of one subject ({4 * args.questions} requests), batch 8")
    answers = {}
    for _ in range(args.rounds):
        for way, match in (("examples once for the subject", sharing.KeptPrefixes.match),
                           ("examples once a batch", lambda *a, **k: None)):
            with mock.patch.object(sharing.KeptPrefixes, "match", match):
                seconds, parts, answers[way] = evaluate(ours, tasks, args.questions)
            print(f"ortmodule, {way}: {seconds:.2f} s ({', '.join(f'{k} {v:.2f} s' for k, v in parts.items())})")
    if not args.no_hf:
        theirs = get_model("hf")(pretrained=str(checkpoint), dtype="float32", device="cpu", batch_size=8)
        seconds, _, answers["hf"] = evaluate(theirs, tasks, args.questions)
        print(f"hf: {seconds:.2f} s")
    name = "hf" if "hf" in answers else "examples once a batch"
    for way, got in answers.items():
        differ = max(abs(a - b) for a, b in zip(got, answers[name], strict=True))
        print(f"{way}: largest loglikelihood difference from {name}'s {differ:.1e}")


if __name__ == "__main__":
    main()
