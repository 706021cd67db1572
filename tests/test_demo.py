"""examples/demo.py's lm-eval comparison: its clock on the backend's requests (the demo itself runs
the real SmolLM2, minutes; here its `evaluate` on a fixture)."""

import importlib.util
from pathlib import Path

import lm_eval
from lm_eval.api.registry import get_model

from ortmodule import tasks

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.py"


def load_demo():
    spec = importlib.util.spec_from_file_location("ortmodule_demo", DEMO)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    return demo


def test_the_demo_clocks_the_backends_requests_and_keeps_their_answers(build):
    """`evaluate` gives lm-eval's results unchanged (equal to a run without its clock) and the time in
    the backend's `loglikelihood` and `generate_until` calls: some of the whole, not all of it (lm-eval's
    own work is around them), and measured anew on a second call (the class's methods clocked, not the
    clock of the call before)."""
    demo = load_demo()
    package = build("llama").package_dir
    manager = tasks.task_manager(demo.TASKS)
    lm = get_model("ortmodule")(pretrained=str(package), device="cpu", batch_size=8)
    plain = lm_eval.simple_evaluate(model=get_model("ortmodule")(pretrained=str(package), device="cpu", batch_size=8),
                                    tasks=demo.TASKS, task_manager=manager, verbosity="ERROR", limit=4)
    for _ in range(2):
        results, whole, in_requests = demo.evaluate(lm, manager, limit=4)
        assert results["results"] == plain["results"]
        assert 0 < in_requests < whole
        assert lm.loglikelihood.__wrapped__ == type(lm).loglikelihood.__get__(lm)
