"""`ortmodule run-batch`'s requests run together against one at a time, and against what a transformers user writes
for the same chats (left-padded batches of `generate`), on the real SmolLM2-135M-Instruct (fp32, greedy, a fixed
number of new tokens each). Prints each way's time and completion tokens/s, and whether run-batch's texts equal
transformers'.

    python benchmarks/run_batch_speed.py [--requests 64] [--new 32] [--repeats 2] [--threads 2]
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from ortmodule.serving import create_app
from ortmodule.serving.batch_file import Output, parse_requests, run_requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's dev helpers: ortmodule_dev
from ortmodule_dev import fixtures  # noqa: E402

WORDS = ["rivers", "glass", "owls", "clocks", "salt", "bridges", "ferns", "copper", "kites", "tides", "wool", "maps",
         "violins", "deserts", "bees", "lanterns"]


def messages(count: int) -> list[list[dict]]:
    pairs = [(a, b) for a in WORDS for b in reversed(WORDS) if a != b][:count]
    return [[{"role": "user", "content": f"Write a sentence about {a} and {b}."}] for a, b in pairs]


def answered(model, tokenizer, url: str, bodies: list[dict], concurrency: int) -> tuple[float, list[dict]]:
    """The bodies as a batch file's lines to `url`, run by run-batch's path (a fresh app over `model`, in this
    process): its seconds and the answers' bodies, in order (every one a 200)."""
    lines = [json.dumps({"custom_id": str(i), "method": "POST", "url": url, "body": body})
             for i, body in enumerate(bodies)]
    with tempfile.TemporaryDirectory() as folder:
        output = Output(f"{folder}/answers.jsonl")
        summary = run_requests(create_app(model, tokenizer, name="smollm2"), parse_requests("\n".join(lines)),
                               output, concurrency, progress=False)
        output.finish()
        answers = [json.loads(line) for line in Path(f"{folder}/answers.jsonl").read_text().splitlines()]
    assert summary.statuses == {200: len(bodies)}, summary.statuses
    return summary.seconds, [a["response"]["body"] for a in answers]


def run_batch(model, tokenizer, chats, new: int, concurrency: int) -> tuple[float, list[str]]:
    bodies = [{"messages": chat, "max_tokens": new, "temperature": 0, "ignore_eos": True} for chat in chats]
    seconds, answers = answered(model, tokenizer, "/v1/chat/completions", bodies, concurrency)
    return seconds, [answer["choices"][0]["message"]["content"] for answer in answers]


def real_model_arguments(parser: argparse.ArgumentParser):
    """The scripts' shared options (`--repeats`, `--threads`) parsed, torch's threads set, and the real model's
    package, tokenizer and transformers model (fixtures.real_models): (args, model, tokenizer, hf)."""
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    return args, *fixtures.real_models()


def transformers_batches(hf, tokenizer, chats, new: int, rows: int) -> tuple[float, list[str]]:
    tokenizer.padding_side = "left"
    prompts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) for chat in chats]
    texts, start = [], time.perf_counter()
    for i in range(0, len(prompts), rows):
        batch = tokenizer(prompts[i:i + rows], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = hf.generate(**batch, max_new_tokens=new, eos_token_id=None, do_sample=False,  # as ignore_eos
                              pad_token_id=tokenizer.pad_token_id)
        texts += tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    return time.perf_counter() - start, texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new", type=int, default=32, help="new tokens of each chat (ignore_eos)")
    args, model, tokenizer, hf = real_model_arguments(parser)
    chats = messages(args.requests)
    rows = 32  # the server's default --max-rows: the batch run-batch decodes together
    tokens = args.requests * args.new
    for repeat in range(args.repeats):
        ways = {"run-batch, 64 at once": lambda: run_batch(model, tokenizer, chats, args.new, 2 * rows),
                "run-batch, one at a time": lambda: run_batch(model, tokenizer, chats, args.new, 1),
                f"transformers generate, batches of {rows}": lambda: transformers_batches(hf, tokenizer, chats,
                                                                                           args.new, rows)}
        results = {name: way() for name, way in ways.items()}
        reference = results[f"transformers generate, batches of {rows}"][1]
        for name, (seconds, texts) in results.items():
            same = sum(a == b for a, b in zip(texts, reference, strict=True))
            print(f"run {repeat}: {name:36s} {seconds:6.2f} s  {tokens / seconds:6.1f} tokens/s  "
                  f"texts as transformers': {same}/{len(texts)}", flush=True)


if __name__ == "__main__":
    main()
