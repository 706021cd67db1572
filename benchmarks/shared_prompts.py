"""Where running a batch's common beginning once pays on this CPU (ortmodule/shared_prompts.py):
`generate(max_new_tokens=1)` (the prompts' prefill and one token) of 8 prompts on the real
SmolLM2-135M packages (fp32, int4), the beginning run once against the whole prompts in every row
(`RUN_TOKENS` forced either way), timed in turns, best of 3. Rows of 96 tokens whose first 8-64
are common (no padding: the break-even that sets `RUN_TOKENS`), and rows of 32-128 tokens after a
common beginning of 16-512 (padding spared too).

    python benchmarks/shared_prompts.py
"""

import sys
from pathlib import Path

import torch

from ortmodule import OrtModelForCausalLM, shared_prompts
from ortmodule.costs import _best_times

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


def main() -> None:
    print("| package | prompts | common beginning | whole prompts ms | beginning once ms | whole / once |")
    print("|---|---|---|---|---|---|")
    generator = torch.Generator().manual_seed(0)
    cases = [("rows of 96", p, [96 - p] * ROWS) for p in (8, 16, 32, 48, 64)]
    cases += [("rows of 32-128 after it", p, torch.linspace(32, 128, ROWS).long().tolist()) for p in (16, 128, 512)]
    for name, spec in (("fp32", fixtures.SMOLLM2), ("int4", fixtures.SMOLLM2_INT4)):
        model = OrtModelForCausalLM.from_pretrained(fixtures.build(spec).package_dir)
        for label, beginning, lengths in cases:
            ids, mask = prompts(beginning, lengths, generator)

            def run(tokens, model=model, ids=ids, mask=mask):
                def call():
                    shared_prompts.RUN_TOKENS = tokens
                    return model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
                return call

            default = shared_prompts.RUN_TOKENS
            once, whole = _best_times([run(0), run(10**9)], torch.device("cpu"), 3)
            shared_prompts.RUN_TOKENS = default
            print(f"| {name} | {label} | {beginning} | {1e3 * whole:.0f} | {1e3 * once:.0f} | {whole / once:.2f}x |",
                  flush=True)


if __name__ == "__main__":
    main()
