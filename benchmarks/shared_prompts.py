"""Where running a batch's common beginning once pays on this CPU (ortmodule/shared_prompts.py), and
which way its rows' rests should run: `generate(max_new_tokens=1)` (the prompts' prefill and one
token) of 8 prompts on the real SmolLM2-135M packages (fp32, int4), the whole prompts in every row,
the beginning once then a run a row (`RUN_TOKENS`), and the beginning once then every rest in one
extend run (`EXTEND_TOKENS`), each forced by the constants, timed in turns, best of 3, with the way
the defaults choose. Rows of 96 tokens whose first 8-64 are common (no padding: the break-even that
sets `RUN_TOKENS`), and rows of 32-128 tokens after a common beginning of 16-512 (padding spared too).

    python benchmarks/shared_prompts.py
    python benchmarks/shared_prompts.py --capacity   # rests in one run into a wider generation cache
"""

import sys
from pathlib import Path

import torch

from ortmodule import OrtModelForCausalLM, shared_prompts
from ortmodule.costs import _best_times
from ortmodule.inputs import check_batch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's dev helpers: ortmodule_dev
from ortmodule_dev import fixtures  # noqa: E402

ROWS = 8


def prompts(beginning: int, lengths: list[int], generator) -> tuple[torch.Tensor, torch.Tensor]:
    common = torch.randint(10, 40000, (beginning,), generator=generator).tolist()
    rows = [common + torch.randint(10, 40000, (n,), generator=generator).tolist() for n in lengths]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(row)) + row for row in rows])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    return ids, mask


WAYS = {"whole": (10**9, 10**9), "a run a row": (0, 10**9), "one run": (10**9, 0)}  # (RUN_TOKENS, EXTEND_TOKENS)


def chosen(model, ids, mask) -> str:
    """The way the default constants choose for these prompts."""
    rows = check_batch(ids, mask, model.decoder.vocab_size, model.decoder.package.context_length, model.device)
    width = rows.ids.shape[1]
    last = torch.arange(ids.shape[0]) * width + rows.lengths - 1
    prefix, extender = shared_prompts.way(model.decoder, rows, last, model.decoder.new_cache(ids.shape[0], width))
    return "whole" if not prefix else "one run" if extender is not None else "a run a row"


def main() -> None:
    print("| package | prompts | common beginning | " + " | ".join(f"{way} ms" for way in WAYS) + " | chosen |")
    print("|---|---|---|" + "---|" * len(WAYS) + "---|")
    generator = torch.Generator().manual_seed(0)
    cases = [("rows of 96", p, [96 - p] * ROWS) for p in (8, 16, 32, 48, 64)]
    cases += [("rows of 32-128 after it", p, torch.linspace(32, 128, ROWS).long().tolist()) for p in (16, 128, 512)]
    defaults = shared_prompts.RUN_TOKENS, shared_prompts.EXTEND_TOKENS
    for name, spec in (("fp32", fixtures.SMOLLM2), ("int4", fixtures.SMOLLM2_INT4)):
        model = OrtModelForCausalLM.from_pretrained(fixtures.build(spec).package_dir)
        for label, beginning, lengths in cases:
            ids, mask = prompts(beginning, lengths, generator)

            def run(constants, model=model, ids=ids, mask=mask):
                def call():
                    shared_prompts.RUN_TOKENS, shared_prompts.EXTEND_TOKENS = constants
                    return model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
                return call

            times = _best_times([run(constants) for constants in WAYS.values()], torch.device("cpu"), 3)
            shared_prompts.RUN_TOKENS, shared_prompts.EXTEND_TOKENS = defaults
            print(f"| {name} | {label} | {beginning} | " + " | ".join(f"{1e3 * t:.0f}" for t in times)
                  + f" | {chosen(model, ids, mask)} |", flush=True)


def capacity() -> None:
    """`--capacity`: the prompts' prefill (`shared_prompts.prefill`, rests in one run) into a generation's
    cache with room for 0, 256 and 1,024 new tokens past the prompts, as `generate(max_new_tokens=...)`
    makes it: 8 rows of 20-60 tokens after 40 common ones, the real SmolLM2-135M fp32, best of 4."""
    model = OrtModelForCausalLM.from_pretrained(fixtures.build(fixtures.SMOLLM2).package_dir)
    decoder = model.decoder
    ids, mask = prompts(40, torch.linspace(20, 60, ROWS).long().tolist(), torch.Generator().manual_seed(0))
    rows = check_batch(ids, mask, decoder.vocab_size, decoder.package.context_length, model.device)
    width = rows.ids.shape[1]
    last = torch.arange(ROWS) * width + rows.lengths - 1
    print(f"| room for new tokens | prefill ms (chosen: {chosen(model, ids, mask)}) |\n|---|---|")
    with torch.inference_mode():
        for room in (0, 256, 1024):
            def call(room=room):
                return shared_prompts.prefill(decoder, rows, last, decoder.new_cache(ROWS, width + room))
            print(f"| {room} | {1e3 * _best_times([call], torch.device('cpu'), 4)[0]:.0f} |", flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--capacity"]:
        capacity()
    else:
        main()
