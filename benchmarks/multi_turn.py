"""transformers' multi-turn chat pattern on the real SmolLM2-135M-Instruct: each turn's `generate` given the
conversation so far, with one `DynamicCache` passed to every turn (the earlier turns' columns kept) or a new
one each turn (the whole conversation run again), ortmodule and transformers on the same weights (fp32, greedy).
Prints each way's total time over the turns and whether its answers equal transformers' with one cache.

    python benchmarks/multi_turn.py [--threads 2] [--new 48] [--repeats 2]
"""

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's dev helpers: ortmodule_dev
from ortmodule_dev import fixtures  # noqa: E402

SYSTEM = "You are a helpful assistant. " * 20
QUESTIONS = ["What is the capital of France?", "And of Italy?", "Which of the two is larger?",
             "Name a famous museum in the first one.", "When was it founded?", "Thank you. Summarize our conversation."]


def user_turn(tokenizer, question: str, first: bool) -> torch.Tensor:
    """The ids a turn adds: the user's message and the assistant's header (the system prompt before the first)."""
    messages = ([{"role": "system", "content": SYSTEM}] if first else []) + [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if not first:
        text = text[text.index("<|im_start|>user"):]
    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])


def chat(model, tokenizer, one_cache: bool, new: int, config) -> tuple[float, list[list[int]], int]:
    """Seconds in `generate` over the turns, each turn's answer ids, and the conversation's final length."""
    past = DynamicCache(config=config) if config is not None else DynamicCache()
    ids, answers, seconds = None, [], 0.0
    end = torch.tensor([[tokenizer.eos_token_id]])
    for i, question in enumerate(QUESTIONS):
        turn = user_turn(tokenizer, question, i == 0)
        ids = turn if ids is None else torch.cat([ids, turn], 1)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                                 past_key_values=past if one_cache else DynamicCache(),
                                 pad_token_id=tokenizer.pad_token_id)
        seconds += time.perf_counter() - start
        answers.append(out[0, ids.shape[1]:].tolist())
        out = out if out[0, -1].item() == tokenizer.eos_token_id else torch.cat([out, end], 1)
        ids = torch.cat([out, torch.tensor([tokenizer("\n", add_special_tokens=False)["input_ids"]])], 1)
    return seconds, answers, ids.shape[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new", type=int, default=48, help="max_new_tokens of each turn")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer, hf = fixtures.real_models()
    ways = [("ortmodule, one DynamicCache", model, True, None),
            ("ortmodule, a new cache each turn", model, False, None),
            ("transformers, one DynamicCache", hf, True, hf.config),
            ("transformers, a new cache each turn", hf, False, hf.config)]
    for repeat in range(args.repeats):
        results = {name: chat(m, tokenizer, one, args.new, config) for name, m, one, config in ways}
        reference = results["transformers, one DynamicCache"][1]
        for name, (seconds, answers, length) in results.items():
            print(f"run {repeat}: {name:36s} {seconds:6.2f} s   answers as transformers': {answers == reference}   "
                  f"conversation {length} tokens")


if __name__ == "__main__":
    main()
