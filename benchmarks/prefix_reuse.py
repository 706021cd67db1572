"""When does `score`'s shared-prefix reuse pay? Times score() with it forced on and off over
query and item lengths, interleaved, best of 3, on the suite's decoder of the chosen size.

    python benchmarks/prefix_reuse.py [--size cpu] [--device cpu]
"""

import argparse
import random
import sys
import time
from pathlib import Path

from conftest import SIZES

import ortmodule
from ortmodule import OrtModelForCausalLM, sharing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's dev helpers: ortmodule_dev
from ortmodule_dev import fixtures  # noqa: E402

SHAPES = [(200, 5), (200, 20), (60, 20), (20, 20)]  # (query tokens, items of 1 to this many tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="cpu", choices=sorted(SIZES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--items", type=int, default=32)
    args = parser.parse_args()
    fixture = fixtures.build(next(iter(SIZES[args.size]["decoders"].values())))
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device=args.device)
    vocab, rng = fixture.spec.vocab_size, random.Random(0)
    print("| query tokens | item tokens | full prefill | shared prefix | chosen by default |")
    print("|---|---|---|---|---|")
    for query_tokens, item_tokens in SHAPES:
        query = [rng.randrange(4, vocab) for _ in range(query_tokens)]
        items = [[rng.randrange(4, vocab) for _ in range(rng.randint(1, item_tokens))] for _ in range(args.items)]
        times = {False: [], True: []}
        for reuse in (False, True):  # warm-up
            ortmodule.score(model, None, query, items, [10, 20, 30], reuse_prefix=reuse)
        for _ in range(3):
            for reuse in (False, True):
                start = time.perf_counter()
                ortmodule.score(model, None, query, items, [10, 20, 30], reuse_prefix=reuse)
                if args.device != "cpu":
                    import torch

                    torch.cuda.synchronize()
                times[reuse].append(time.perf_counter() - start)
        full, shared = min(times[False]), min(times[True])
        prompts = [query + item for item in items]
        costs = model.measured_costs()
        chosen = "shared prefix" if sharing.worth_sharing(prompts, [len(p) - 1 for p in prompts], costs,
                                                          packed=sharing.packs(model)) else "full prefill"
        print(f"| {query_tokens} | 1-{item_tokens} | {1000 * full:.0f} ms | {1000 * shared:.0f} ms | "
              f"{chosen} ({full / shared:.1f}x) |")


if __name__ == "__main__":
    main()
