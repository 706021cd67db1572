"""How close a 4-bit (or 8-bit) package of the real SmolLM2-135M-Instruct stays to its fp32 package, for each
of the model builder's 4-bit options, and what each costs. For every option (exported once, cached
like the test fixtures), on English prose that ships with Python (pydoc_data's topics; 8 windows of
512 tokens): the perplexity, the mean KL divergence of its next-token distribution from the fp32
package's, and how often its top token is the fp32 package's; then the package's size, one
forward's time (8 x 128 tokens, `cont_len=4`) and batch-1 greedy decoding's tokens/s, each the best
of 3.

    python benchmarks/int4_options.py [--option algo_config=k_quant_mixed ...]

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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's dev helpers: ortmodule_dev
from ortmodule_dev import fixtures  # noqa: E402

OPTIONS = ["default", "block_size=16", "algo_config=rtn_last", "algo_config=k_quant", "algo_config=k_quant_last",
           "algo_config=k_quant_mixed", "precision=int8"]
WINDOWS, LENGTH = 8, 512


def variant(option: str) -> fixtures.FixtureSpec:
    """The int4 package exported with the builder option `KEY=VALUE` ('default': none; `precision=int8`:
    the 8-bit package instead)."""
    if option == "default":
        return fixtures.SMOLLM2_INT4
    key, sep, value = option.partition("=")
    if not sep or not key or not value:
        raise SystemExit(f"--option {option!r}: expected KEY=VALUE (a model builder option) or 'default'")
    if key == "precision":
        return dataclasses.replace(fixtures.SMOLLM2_INT4, precision=value)
    return dataclasses.replace(fixtures.SMOLLM2_INT4, extra_options=((key, value),))


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
    options = parser.parse_args().option or OPTIONS
    reference = fixtures.build(fixtures.SMOLLM2)
    text = "\n\n".join(list(pydoc_data.topics.topics.values())[:60])
    ids = torch.tensor(load_tokenizer(reference.package_dir)(text).input_ids[: WINDOWS * LENGTH]).view(WINDOWS, LENGTH)
    rows = []
    for option, spec in [("fp32 package", fixtures.SMOLLM2)] + [(o, variant(o)) for o in options]:
        print(f"exporting or finding the package: {option}", file=sys.stderr, flush=True)
        fixture = fixtures.build(spec)
        model = OrtModelForCausalLM.from_pretrained(fixture.package_dir)
        lp = log_probs(model, ids)
        if not rows:
            fp32 = lp
        nll = -lp[:, :-1].gather(2, ids[:, 1:, None]).mean()
        kl = (fp32.exp() * (fp32 - lp)).sum(-1).mean()
        top1 = (fp32.argmax(-1) == lp.argmax(-1)).float().mean()
        size = sum(f.stat().st_size for f in fixture.package_dir.glob("*.onnx*")) / 1e6
        rows.append((option, size, float(nll.exp()), float(kl), float(top1), *speed(model)))
    print(f"\nSmolLM2-135M-Instruct, {WINDOWS} windows of {LENGTH} tokens of pydoc_data's topics; this machine's CPU\n")
    print("| builder option | package MB | perplexity | KL from fp32 | top token = fp32's | forward 8 x 128 ms | "
          "decode tokens/s |")
    print("|---|---|---|---|---|---|---|")
    for option, size, ppl, kl, top1, forward, decode in rows:
        print(f"| {option} | {size:.0f} | {ppl:.2f} | {kl:.3f} | {100 * top1:.1f}% | {forward:.0f} | {decode:.1f} |")


if __name__ == "__main__":
    main()
