"""A hybrid package on a CPU (LFM2-350M's sizes, random weights, fp32; the suite's `LFM2_350M_CPU`; or with
`--model qwen3_5` Qwen3.5 at about 0.8B's sizes, `QWEN3_5_08B_CPU`): ortmodule against transformers on the same
weights, timed in turns (median of `--rounds`). transformers runs Qwen3.5's gated delta rule by its PyTorch
fallback (flash-linear-attention, which it prefers, needs a GPU).

- scoring: rows of 256 tokens, logits at the last 4 positions (`cont_len` / `logits_to_keep`);
- generate: greedy, prompts of 32 tokens, 32 new tokens, batch 1 and 8;
- `--shared`: 16 HellaSwag-shaped questions scored by ortmodule three ways (sliding_windows.py's):
  padded rows, shared contexts continued by decode steps, shared contexts in one extend run.
- `--crops`: what the cache's copies of the convolution states cost (cache.py's checkpoints, made
  after every step where generate returns the cache): greedy generate, batch 1 and 8, with
  `return_dict_in_generate` and without; then prompt lookup (`prompt_lookup_num_tokens=8`, crops
  inside each round's run) against greedy decoding, ortmodule's and transformers', on a 96-token
  prompt that repeats its first 32 tokens after their greedy continuation. Each way's tokens are
  compared with the first's (a difference of 0: the same tokens).

Each of ortmodule's results is checked against transformers' first (logits within 1e-3 of their
largest, the same tokens). A synthetic workload of a real model's sizes: the layer pattern is the
fixtures' (two convolution layers to one attention layer: 11 and 5 of 16; LFM2-350M has 10 and 6),
and no trained weights exist offline to score real text with.

    python benchmarks/hybrid.py
    python benchmarks/hybrid.py --model qwen3_5
    python benchmarks/hybrid.py --shared
    python benchmarks/hybrid.py --crops
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from conftest import LFM2_350M_CPU, QWEN3_5_08B_CPU
from sliding_windows import shared_ways
from sliding_windows import timed as timed_ways
from transformers import AutoModelForCausalLM

from ortmodule import OrtModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's dev helpers: ortmodule_dev
from ortmodule_dev import fixtures  # noqa: E402

# --model: (fixture spec, what its sizes are, its stateful layers' kind)
MODELS = {"lfm2": (LFM2_350M_CPU, "LFM2-350M's sizes", "convolution"),
          "qwen3_5": (QWEN3_5_08B_CPU, "Qwen3.5 at about 0.8B's sizes", "linear attention")}


def timed(label: str, ours, theirs, same, rounds: int) -> None:
    """Check `same(ours(), theirs())`, then time both `rounds` times in turns."""
    same(ours(), theirs())
    times = {"ortmodule": [], "transformers": []}
    for _ in range(rounds):
        for name, way in (("ortmodule", ours), ("transformers", theirs)):
            start = time.perf_counter()
            way()
            times[name].append(time.perf_counter() - start)
    ort_s, hf_s = (statistics.median(times[name]) for name in ("ortmodule", "transformers"))
    print(f"{label}: ortmodule {ort_s:.3f} s, transformers {hf_s:.3f} s ({hf_s / ort_s:.2f}x)")


def close(got: torch.Tensor, expected: torch.Tensor) -> None:
    error, scale = (got - expected).abs().max().item(), expected.abs().max().item()
    if error > 1e-3 * max(1.0, scale):
        raise SystemExit(f"ortmodule's logits differ from transformers' by {error:.3g} (largest {scale:.3g})")


def equal(got: torch.Tensor, expected: torch.Tensor) -> None:
    if not torch.equal(got, expected):
        raise SystemExit("ortmodule's greedy tokens differ from transformers'")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shared", action="store_true", help="shared contexts: padded, decode steps, extend")
    parser.add_argument("--crops", action="store_true", help="the states' copies for crops; prompt lookup")
    parser.add_argument("--model", choices=sorted(MODELS), default="lfm2")
    args = parser.parse_args()
    fixture = fixtures.build(MODELS[args.model][0])
    ours = OrtModelForCausalLM.from_pretrained(fixture.package_dir)
    if args.shared:
        with torch.no_grad():
            timed_ways(shared_ways(ours), args.rounds)
        return
    theirs = AutoModelForCausalLM.from_pretrained(fixture.hf_dir, dtype=torch.float32).eval()
    stateful = len({state.layer for state in ours.decoder.spec.states})
    print(f"{MODELS[args.model][1]}, random weights, fp32, {torch.get_num_threads()} threads; "
          f"{stateful} {MODELS[args.model][2]} layers, {len(ours.decoder.spec.layers)} attention layers")
    generator = torch.Generator().manual_seed(0)
    if args.crops:
        with torch.no_grad():
            crops(ours, theirs, generator, args.rounds)
        return
    with torch.no_grad():
        ids = torch.randint(4, 60000, (8, 256), generator=generator)
        timed("scoring 8 x 256, last 4 logits", lambda: ours(ids, cont_len=4).logits,
              lambda: theirs(ids, logits_to_keep=4).logits, close, args.rounds)
        kwargs = dict(max_new_tokens=32, do_sample=False, min_new_tokens=32, pad_token_id=0)
        for batch in (1, 8):
            prompts = torch.randint(4, 60000, (batch, 32), generator=generator)
            timed(f"generate batch {batch}, 32 + 32 tokens", lambda p=prompts: ours.generate(p, **kwargs),
                  lambda p=prompts: theirs.generate(p, attention_mask=torch.ones_like(p), **kwargs), equal, args.rounds)


def crops(ours, theirs, generator, rounds: int) -> None:
    kwargs = dict(max_new_tokens=32, do_sample=False, min_new_tokens=32, pad_token_id=0)
    for batch in (1, 8):
        prompts = torch.randint(4, 60000, (batch, 32), generator=generator)
        print(f"generate batch {batch}, 32 + 32 tokens, ortmodule:")
        timed_ways({"without the copies": lambda p=prompts: ours.generate(p, **kwargs),
                    "with the copies (return_dict_in_generate)": lambda p=prompts: ours.generate(
                        p, return_dict_in_generate=True, **kwargs).sequences}, rounds)
    start = torch.randint(4, 60000, (1, 32), generator=generator)
    prompt = torch.cat([theirs.generate(start, **kwargs), start], 1)
    lookup = dict(kwargs, prompt_lookup_num_tokens=8)
    print("prompt lookup, batch 1, 96 + 32 tokens:")
    timed_ways({"ortmodule greedy": lambda: ours.generate(prompt, **kwargs),
                "ortmodule lookup": lambda: ours.generate(prompt, **lookup),
                "transformers greedy": lambda: theirs.generate(prompt, **kwargs),
                "transformers lookup": lambda: theirs.generate(prompt, **lookup)}, rounds)
    accepted = int((ours.generate(prompt, **kwargs)[0, prompt.shape[1]:] == prompt[0, 32:64]).sum())
    print(f"new tokens equal to the text after the repeated part (drafts lookup could have accepted): {accepted}")


if __name__ == "__main__":
    main()
