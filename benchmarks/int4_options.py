"""How close a 4-bit (or 8-bit) package of the real SmolLM2-135M-Instruct stays to its fp32 package, for each
of the model builder's 4-bit options, and what each costs. For every option (exported once, cached
like the test fixtures), on English prose that ships with Python (pydoc_data's topics; 8 windows of
512 tokens): the perplexity, the mean KL divergence of its next-token distribution from the fp32
package's, and how often its top token is the fp32 package's; the share of MMLU-shaped questions
(benchmarks/tasks: 5-shot prompts of 300-900 tokens, `--questions` of them) whose letter it picks
as the fp32 package does (the benchmark suite's `same_choice_as_fp32`); then the package's size, one
forward's time (8 x 128 tokens, `cont_len=4`) and batch-1 greedy decoding's tokens/s, each the best
of 3.

    python benchmarks/int4_options.py [--option algo_config=k_quant_mixed ...] [--questions 200]

`--option` replaces the list below (`default` is the builder's plain int4 export, `precision=int8` its
8-bit one). Each option's variant
takes about 40 s to export on 2 CPU cores.
"""

import argparse
import dataclasses
import pydoc_data.topics
import sys
import time
from pathlib import Path

import torch

from ortmodule import OrtModelForCausalLM, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks" / "tasks")]  # the dev helpers, the workloads' loaders
import graph_options  # noqa: E402
import loaders  # noqa: E402

from ortmodule_dev import fixtures  # noqa: E402

OPTIONS = ["default", "block_size=16", "algo_config=rtn_last", "algo_config=k_quant", "algo_config=k_quant_last",
           "algo_config=k_quant_mixed", "precision=int8"]
WINDOWS, LENGTH = 8, 512


def variant(option: str) -> fixtures.FixtureSpec:
    """The int4 package exported with the builder option `KEY=VALUE` ('default': none; `precision=int8`:
    the 8-bit package instead)."""
    if option.startswith("precision="):
        return dataclasses.replace(fixtures.SMOLLM2_INT4, precision=option.partition("=")[2])
    return graph_options.variant(fixtures.SMOLLM2_INT4, option)


@torch.inference_mode()
def letters_chosen(model, prompts: list[torch.Tensor], letters: torch.Tensor) -> torch.Tensor:
    """The letter (0-3) of largest logit after each MMLU-shaped prompt."""
    return torch.stack([model(ids[None], cont_len=1).logits[0, -1, letters].argmax() for ids in prompts])


@torch.inference_mode()
def log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.log_softmax(model(ids[i : i + 2]).logits.float(), -1) for i in range(0, len(ids), 2)])


def speed(model) -> tuple[float, float]:
    """(ms of one forward of 8 x 128 tokens with cont_len=4, tokens/s of batch-1 greedy decoding of 64
    tokens after 64), each the best of 3."""
    ids = torch.randint(4, 49000, (8, 128), generator=torch.Generator().manual_seed(0))

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    forward = best(lambda: model(ids, cont_len=4))
    decode = best(lambda: model.generate(ids[:1, :64], max_new_tokens=64, min_new_tokens=64, do_sample=False))
    return 1e3 * forward, 64 / decode


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--option", action="append", metavar="KEY=VALUE", help=f"default: {' '.join(OPTIONS)}")
    parser.add_argument("--questions", type=int, default=200, help="MMLU-shaped questions")
    args = parser.parse_args()
    options = args.option or OPTIONS
    reference = fixtures.build(fixtures.SMOLLM2)
    tokenizer = load_tokenizer(reference.package_dir)
    text = "\n\n".join(list(pydoc_data.topics.topics.values())[:60])
    ids = torch.tensor(tokenizer(text).input_ids[: WINDOWS * LENGTH]).view(WINDOWS, LENGTH)
    docs = loaders.bench_mmlu(str(reference.hf_dir), questions=args.questions)["test"]
    prompts = [torch.tensor(tokenizer(doc["prompt"]).input_ids) for doc in docs]
    letters = torch.tensor([tokenizer(" " + letter, add_special_tokens=False).input_ids[-1] for letter in "ABCD"])
    rows = []
    for option, spec in [("fp32 package", fixtures.SMOLLM2)] + [(o, variant(o)) for o in options]:
        print(f"exporting or finding the package: {option}", file=sys.stderr, flush=True)
        fixture = fixtures.build(spec)
        model = OrtModelForCausalLM.from_pretrained(fixture.package_dir)
        lp, chosen = log_probs(model, ids), letters_chosen(model, prompts, letters)
        if not rows:
            fp32, fp32_chosen = lp, chosen
        nll = -lp[:, :-1].gather(2, ids[:, 1:, None]).mean()
        kl = (fp32.exp() * (fp32 - lp)).sum(-1).mean()
        top1 = (fp32.argmax(-1) == lp.argmax(-1)).float().mean()
        size = sum(f.stat().st_size for f in fixture.package_dir.glob("*.onnx*")) / 1e6
        same = (chosen == fp32_chosen).float().mean()
        rows.append((option, size, float(nll.exp()), float(kl), float(top1), float(same), *speed(model)))
    print(f"\nSmolLM2-135M-Instruct, {WINDOWS} windows of {LENGTH} tokens of pydoc_data's topics, {args.questions} "
          "MMLU-shaped questions; this machine's CPU\n")
    print("| builder option | package MB | perplexity | KL from fp32 | top token = fp32's | MMLU-shaped answer = "
          "fp32's | forward 8 x 128 ms | decode tokens/s |")
    print("|---|---|---|---|---|---|---|---|")
    for option, size, ppl, kl, top1, same, forward, decode in rows:
        print(f"| {option} | {size:.0f} | {ppl:.2f} | {kl:.3f} | {100 * top1:.1f}% | {100 * same:.1f}% | {forward:.0f} "
              f"| {decode:.1f} |")


if __name__ == "__main__":
    main()
