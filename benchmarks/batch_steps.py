"""A step of several tokens over a batch's cache (`model(tokens [B, s], past_key_values=cache)`, as
scoring code that extends a cached prefix, or `generate` continued from a returned cache with more
text, makes it) on this CPU: a decode step a token against one run of the writing extender a prefill
chunk at a time (decoder.py's `_several_tokens`), each forced through shared_prompts' prices, on the
real SmolLM2-135M packages (fp32, int4). Random tokens; the prefix's prefill is not timed; the two
ways in turns, best of 5; the way the defaults choose beside them, and how far apart the logits are.

    python benchmarks/batch_steps.py
"""

import sys
import time
from pathlib import Path

import torch

from ortmodule import OrtModelForCausalLM, shared_prompts

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's dev helpers: ortmodule_dev
from ortmodule_dev import fixtures  # noqa: E402

WAYS = {"a step a token": 10**9, "one run": 0}  # shared_prompts.EXTEND_TOKENS forcing each
CASES = [(8, 64, s) for s in (2, 3, 4, 8, 16, 64)] + [(4, 512, 3), (4, 512, 16), (32, 32, 4)]  # rows, past, new


def timed(model, ids, tokens, extend_tokens):
    """Seconds of the step (the prefix prefilled first, untimed) and its logits."""
    cache = model(ids, use_cache=True, cont_len=1).past_key_values
    shared_prompts.EXTEND_TOKENS = extend_tokens
    start = time.perf_counter()
    logits = model(tokens, past_key_values=cache).logits
    return time.perf_counter() - start, logits


def main() -> None:
    default = shared_prompts.EXTEND_TOKENS
    print("| package | rows | past | new tokens a row | " + " | ".join(f"{way} ms" for way in WAYS)
          + " | ratio | chosen | max logit diff |")
    print("|---|---|---|---|" + "---|" * len(WAYS) + "---|---|---|")
    generator = torch.Generator().manual_seed(0)
    for name, spec in (("fp32", fixtures.SMOLLM2), ("int4", fixtures.SMOLLM2_INT4)):
        model = OrtModelForCausalLM.from_pretrained(fixtures.build(spec).package_dir)
        for rows, past, new in CASES:
            ids = torch.randint(10, 40000, (rows, past), generator=generator)
            tokens = torch.randint(10, 40000, (rows, new), generator=generator)
            best = {way: float("inf") for way in WAYS}
            logits = {}
            for round in range(6):  # the first round warms up (and makes the extender)
                for way, extend_tokens in WAYS.items():
                    seconds, logits[way] = timed(model, ids, tokens, extend_tokens)
                    if round:
                        best[way] = min(best[way], seconds)
            shared_prompts.EXTEND_TOKENS = default
            chosen = "one run" if shared_prompts.several_tokens_pay(new) else "a step a token"
            diff = (logits["one run"] - logits["a step a token"]).abs().max().item()
            print(f"| {name} | {rows} | {past} | {new} | " + " | ".join(f"{1e3 * best[w]:.0f}" for w in WAYS)
                  + f" | {best['a step a token'] / best['one run']:.2f}x | {chosen} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
