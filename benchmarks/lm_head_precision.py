"""How often bf16 logits change an MMLU-shaped answer, and what a float32 LM head gives back.

The builder's bf16 packages round the LM head's output to bf16 (then cast it to float32), as
transformers in bf16 does. MMLU's answer is the letter of largest logit at one position, and bf16
keeps 8 significant bits: near-ties among the four letters fall either way, and exact ties go to
the first letter. `OrtModelForCausalLM.from_pretrained(..., rewrite_lm_head="float32")` multiplies
the head in float32 instead (graph.py). This script measures the effect on the real SmolLM2-135M
with transformers alone (ONNX Runtime has no bf16 kernels on a CPU): per question of the MMLU-shaped
task (benchmarks/tasks), the letter chosen by

- `fp32`: the model in float32 (the yardstick, as in the benchmark suite's `same_choice_as_fp32`);
- `bf16 logits`: the model in bf16 (what a bf16 package returns, and lm-eval's `hf` in bf16);
- `bf16, float32 head`: the same bf16 hidden state, the head's products summed and kept in float32;

and prints the share of questions where each agrees with `fp32`, and how many bf16 rows tie.

    python benchmarks/lm_head_precision.py [--questions 400] [--device cpu]
"""

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks" / "tasks")]
import loaders  # noqa: E402

from ortmodule_dev import fixtures  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--questions", type=int, default=400)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    fixture = fixtures.build(fixtures.SMOLLM2)
    tokenizer = AutoTokenizer.from_pretrained(fixture.hf_dir)
    docs = loaders.bench_mmlu(str(fixture.hf_dir), questions=args.questions)["test"]
    letters = torch.tensor([tokenizer(" " + letter, add_special_tokens=False)["input_ids"][-1] for letter in "ABCD"],
                           device=args.device)
    fp32 = AutoModelForCausalLM.from_pretrained(fixture.hf_dir, dtype=torch.float32).to(args.device).eval()
    bf16 = AutoModelForCausalLM.from_pretrained(fixture.hf_dir, dtype=torch.bfloat16).to(args.device).eval()
    head = bf16.lm_head.weight[letters].float()  # bf16 values, multiplied and summed in float32
    agree = {"bf16 logits": 0, "bf16, float32 head": 0}
    ties, start = 0, time.perf_counter()
    with torch.inference_mode():
        for i, doc in enumerate(docs, 1):
            ids = torch.tensor([tokenizer(doc["prompt"])["input_ids"]], device=args.device)
            chosen = fp32(ids, logits_to_keep=1).logits[0, -1, letters].argmax().item()
            hidden = bf16.model(ids).last_hidden_state[0, -1]
            rounded = bf16.lm_head(hidden)[letters].float()
            agree["bf16 logits"] += rounded.argmax().item() == chosen  # argmax: the first of tied letters
            agree["bf16, float32 head"] += (head @ hidden.float()).argmax().item() == chosen
            ties += int((rounded == rounded.max()).sum().item() > 1)
            if i % 50 == 0 or i == len(docs):
                shares = ", ".join(f"{name} {count / i:.1%}" for name, count in agree.items())
                print(f"{i} questions: same choice as fp32: {shares}; bf16 ties for the top letter: {ties} "
                      f"({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
