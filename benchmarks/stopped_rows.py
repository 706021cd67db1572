"""Rows that stop before the others, on the real SmolLM2-135M-Instruct fp32 package (the demo's,
exported by `python examples/demo.py`), on a CPU: the figures of docs/measurements.md's session 69.

    python benchmarks/stopped_rows.py [--package DIR]

1. A decode step's time by its rows (`Decoder.step` over rows of 300 and 800 tokens): what a row that
   stays in the steps after it has ended costs.
2. Greedy `generate` of 8 chat prompts (160 new tokens at most), with the ended rows kept in the steps
   (transformers' way) and leaving them (ortmodule's on a CPU): the same tokens, the time of each.
3. lm-eval's `generate_until` on 16 few-shot description requests (until a blank line or "Question:",
   96 tokens at most, batch 8) with lm-eval's own stopping criteria, each row stopped on its own, and
   each row stopped on its own with the stopped rows leaving the steps: the same answers, the times.
"""

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

import ortmodule
from ortmodule import generation
from ortmodule import lm_eval as backend
from ortmodule.inputs import Rows

DEMO = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ortmodule/demo/SmolLM2-135M-Instruct-fp32"
TOPICS = ["the sea", "a cat", "mountains", "a city at night", "rain", "an old book", "the moon", "a train", "coffee",
          "winter", "a garden", "the desert", "music", "a bridge", "friendship", "a storm"]
QUESTIONS = ["What is the capital of France?", "Write a short poem about the sea.", "Name three primary colors.",
             "Explain how a bicycle works in detail.", "What is 2 plus 2?", "Tell me a story about a dragon.",
             "List the planets of the solar system.", "Say hello."]


def timed(run, repeats: int = 2) -> tuple[list[float], object]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = run()
        times.append(round(time.perf_counter() - start, 2))
    return times, out


def step_costs(model) -> None:
    decoder = model.decoder
    for length in (300, 800):
        for rows in (1, 2, 4, 8, 16):
            cache = decoder.new_cache(rows, length + 16)
            ids = torch.randint(100, 40000, (rows, length))
            decoder.prefill(Rows(ids, None, torch.full((rows,), length), length), None, cache)
            held, tokens, times = cache.lengths.clone(), torch.randint(100, 40000, (rows, 1)), []
            for _ in range(12):
                start = time.perf_counter()
                decoder.step(tokens, cache, torch.arange(rows))
                cache.lengths.copy_(held)  # the same past every time
                times.append(time.perf_counter() - start)
            print(f"decode step, {rows:2d} rows of {length} tokens: {1000 * statistics.median(times[2:]):.1f} ms")


def chats(model, package: Path) -> None:
    tokenizer = ortmodule.load_tokenizer(package)
    tokenizer.padding_side = "left"
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             for q in QUESTIONS]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    dropping = generation._Running.drop_stopped
    results = {}
    for name, drop in (("ended rows kept in the steps", lambda self, unfinished: None), ("ended rows leave", dropping)):
        generation._Running.drop_stopped = drop
        results[name] = timed(lambda: model.generate(**batch, max_new_tokens=160, do_sample=False))
    generation._Running.drop_stopped = dropping
    (kept, a), (left, b) = results.values()
    lengths = ((a[:, batch.input_ids.shape[1]:] != tokenizer.pad_token_id).sum(1)).tolist()
    print(f"generate, 8 chats (new tokens {lengths}): kept {kept} s, leaving {left} s, same tokens {torch.equal(a, b)}")


def generate_until(package: Path) -> None:
    lm = backend.OrtModuleLM(pretrained=str(package), batch_size=8)
    shot = "Question: Describe the sun.\nAnswer: The sun is a bright star that gives light and warmth to the Earth.\n\n"
    options = {"until": ["\n\n", "Question:"], "max_gen_toks": 96, "do_sample": False}
    requests = [Instance("generate_until", None, (f"{shot}Question: Describe {topic}.\nAnswer:", options), i)
                for i, topic in enumerate(TOPICS)]
    own, dropping = backend.OrtModuleLM._model_generate, generation._Running.drop_stopped
    ways = {"lm-eval's criteria": (HFLM._model_generate, dropping),
            "each row on its own, kept in the steps": (own, lambda self, unfinished: None),
            "each row on its own, leaving the steps": (own, dropping)}
    answers = {}
    for name, (model_generate, drop) in ways.items():
        backend.OrtModuleLM._model_generate, generation._Running.drop_stopped = model_generate, drop
        times, answers[name] = timed(lambda: lm.generate_until(requests, disable_tqdm=True))
        print(f"generate_until, 16 requests, {name}: {times} s")
    backend.OrtModuleLM._model_generate, generation._Running.drop_stopped = own, dropping
    print(f"the same answers: {len({tuple(a) for a in answers.values()}) == 1}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", type=Path, default=DEMO)
    package = parser.parse_args().package
    model = ortmodule.OrtModelForCausalLM.from_pretrained(package)
    step_costs(model)
    chats(model, package)
    generate_until(package)


if __name__ == "__main__":
    main()
