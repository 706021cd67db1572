"""lm-eval through ortmodule and through transformers, on the same weights, side by side.

The model is examples/arithmetic_model: a tiny Llama trained here to add numbers in words
(examples/train_arithmetic.py). The demo exports it to an ONNX GenAI package with
onnxruntime-genai's model builder (once, then cached), runs ortmodule's shipped arithmetic tasks
(multiple choice and generation) through lm-eval's `ortmodule` backend on the package and its
`hf` backend on the PyTorch checkpoint, and prints both result tables and the speed ratio.

Run: python examples/demo.py [--batch_size 8] [--model path/to/hf_checkpoint]
"""

import argparse
import hashlib
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import lm_eval
from lm_eval.api.registry import get_model
from lm_eval.tasks import TaskManager
from lm_eval.utils import make_table

import ortmodule.lm_eval  # noqa: F401  (registers the ortmodule backend)
from ortmodule import fixtures, tasks
from ortmodule.graph import cache_home

MODEL = Path(__file__).parent / "arithmetic_model"
TASKS = ["ortmodule_arithmetic_mc", "ortmodule_arithmetic_gen"]


def package_for(checkpoint: Path) -> Path:
    """The checkpoint exported by the model builder, cached under a hash of its weights."""
    digest = hashlib.sha256((checkpoint / "model.safetensors").read_bytes()).hexdigest()[:16]
    package = cache_home() / "demo" / f"{checkpoint.name}-{digest}"
    if not (package / "genai_config.json").is_file():
        print(f"Exporting {checkpoint} with onnxruntime-genai's model builder -> {package}", flush=True)
        fixtures.export(checkpoint, package)
    return package


def evaluate(lm) -> tuple[dict, float]:
    start = time.perf_counter()
    results = lm_eval.simple_evaluate(model=lm, tasks=TASKS, task_manager=TaskManager(include_path=tasks.TASK_DIR),
                                      verbosity="ERROR")
    return results, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=MODEL, help="a transformers checkpoint folder")
    parser.add_argument("--batch_size", type=int, default=8)
    args = parser.parse_args()

    package = package_for(args.model)
    ours = get_model("ortmodule")(pretrained=str(package), device="cpu", batch_size=args.batch_size)
    theirs = get_model("hf")(pretrained=str(args.model), dtype="float32", device="cpu", batch_size=args.batch_size)
    evaluate(ours), evaluate(theirs)  # warm-up: first-call costs stay out of the timing
    ours_results, ours_time = evaluate(ours)
    theirs_results, theirs_time = evaluate(theirs)

    print(f"\nlm-eval --model ortmodule (ONNX GenAI package {package}):")
    print(make_table(ours_results))
    print(f"lm-eval --model hf (the same weights in PyTorch, {args.model}):")
    print(make_table(theirs_results))
    same = all(
        ours_results["results"][task][metric] == theirs_results["results"][task][metric]
        for task in TASKS for metric in theirs_results["results"][task] if metric.endswith(",none") and "stderr" not in metric
    )
    print(f"Same scores: {'yes' if same else 'NO'}")
    print(f"Time for both tasks: ortmodule {ours_time:.2f} s, hf {theirs_time:.2f} s: "
          f"ortmodule is {theirs_time / ours_time:.2f}x the speed of hf (batch {args.batch_size}, CPU)")


if __name__ == "__main__":
    main()
