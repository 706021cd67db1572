"""ONNX Runtime's prefill against transformers' (fp32, sdpa) on the same weights, by row length and
batch, on the CPU: the real SmolLM2-135M package, logits at the last `--keep` positions of each row
(`model(ids, cont_len=keep)` against `logits_to_keep=keep`), best of two runs after a warm-up.
`ortmodule` is the default (rows of 512 tokens and more in chunks of 256 over their own cache,
ortmodule/chunked.py); `one prefill` is the same package with `prefill_chunk=0`.

    python benchmarks/prefill_lengths.py [--keep 4] [--long]    # --long adds 1 x 4,096 and 1 x 8,192
"""

import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from ortmodule import OrtModelForCausalLM
from ortmodule.costs import _best_time

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's dev helpers: ortmodule_dev
from ortmodule_dev import fixtures  # noqa: E402

# (rows, length): one batch of about a thousand tokens at growing lengths, then batches of growing
# size at an MMLU-like and a HellaSwag-like length.
SHAPES = [(8, 128), (4, 256), (2, 512), (1, 1024), (1, 640), (2, 640), (4, 640), (8, 640), (16, 640),
          (4, 110), (8, 110), (16, 110), (32, 110), (64, 110)]
LONG = [(1, 4096), (1, 8192)]


def best(fn, repeats: int = 2) -> float:
    return _best_time(fn, torch.device("cpu"), repeats)  # warm-up, then the best of `repeats`


@torch.inference_mode()
def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--keep", type=int, default=4)
    parser.add_argument("--long", action="store_true", help="add single rows of 4,096 and 8,192 tokens")
    args = parser.parse_args()
    fixture = fixtures.build(fixtures.SMOLLM2)
    ours = OrtModelForCausalLM.from_pretrained(fixture.package_dir)
    whole = OrtModelForCausalLM.from_pretrained(fixture.package_dir, prefill_chunk=0)
    theirs = AutoModelForCausalLM.from_pretrained(fixture.hf_dir, dtype=torch.float32, attn_implementation="sdpa")
    theirs.eval()
    generator = torch.Generator().manual_seed(0)
    for rows, length in SHAPES + (LONG if args.long else []):
        ids = torch.randint(10, 40000, (rows, length), generator=generator)
        mine = best(lambda ids=ids: ours(ids, cont_len=args.keep))
        one = best(lambda ids=ids: whole(ids, cont_len=args.keep))
        hf = best(lambda ids=ids: theirs(ids, logits_to_keep=args.keep))
        tokens = rows * length
        print(f"{rows:3d} x {length:5d}: ortmodule {mine * 1e3:7.0f} ms ({mine / tokens * 1e6:5.0f} us/token), "
              f"one prefill {one * 1e3:7.0f} ms, transformers {hf * 1e3:7.0f} ms "
              f"({hf / tokens * 1e6:5.0f} us/token), {hf / mine:.2f}x", flush=True)


if __name__ == "__main__":
    main()
