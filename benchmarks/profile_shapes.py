"""What a new input shape costs on the GPU: ortmodule's attention kernels (runtime.CUDA_ATTENTION_KERNELS)
against ONNX Runtime's own choice (`sdpa_kernel` 0: cuDNN's SDPA on Hopper, which builds a graph for
every new shape), on the Qwen3-0.6B-shaped bf16 package.

For each: lm-eval-shaped forward batches (32 rows, `cont_len=4`) at 12 widths not seen before, then
the same 12 again; greedy generation (8 rows, 16 tokens) from 3 new prompt widths, then again; and
the benchmark's lm-eval task end to end (100 questions, 400 requests; context sharing auto and on),
beside lm-eval's `hf` backend (bf16, sdpa) on the same weights.

    python benchmarks/profile_shapes.py [--spec qwen3-0.6b-bf16]
"""

import argparse
import sys
import time
from pathlib import Path

import lm_eval
import torch
from conftest import SIZES
from lm_eval.api.registry import get_model
from lm_eval.tasks import TaskManager

import ortmodule.lm_eval  # noqa: F401  (registers the backend)
from ortmodule import OrtModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's dev helpers: ortmodule_dev
from ortmodule_dev import fixtures  # noqa: E402

TASK_DIR = str(Path(__file__).parent / "tasks")
TASK = "ortmodule_bench_mc"


def synced(fn) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def shapes(model, label: str, device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    widths, vocab = list(range(170, 254, 7)), min(30000, model.config.vocab_size)
    batches = [torch.randint(4, vocab, (32, w), generator=gen).to(device) for w in widths]
    synced(lambda: model(batches[0][:, :100], cont_len=4))  # first call of the session off the clock
    for round_ in ("new widths", "same widths again"):
        times = [synced(lambda ids=ids: model(ids, cont_len=4)) for ids in batches]
        print(f"{label}: forward 32 rows x {widths[0]}..{widths[-1]} tokens, {round_}: total {sum(times) * 1e3:.0f} ms,"
              f" per batch min {min(times) * 1e3:.1f} / max {max(times) * 1e3:.1f} ms", flush=True)
    prompts = [torch.randint(4, vocab, (8, w), generator=gen).to(device) for w in (97, 131, 163)]
    for round_ in ("new widths", "same widths again"):
        total = sum(synced(lambda p=p: model.generate(p, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                                        pad_token_id=0)) for p in prompts)
        print(f"{label}: generate 8 rows x 16 tokens from 3 prompt widths, {round_}: {total * 1e3:.0f} ms", flush=True)


def lm_eval_seconds(lm, manager) -> float:
    lm_eval.simple_evaluate(model=lm, tasks=[TASK], task_manager=manager, limit=2, verbosity="ERROR")
    start = time.perf_counter()
    lm_eval.simple_evaluate(model=lm, tasks=[TASK], task_manager=manager, limit=100, verbosity="ERROR")
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", default="qwen3-0.6b-bf16")
    parser.add_argument("--size", default="gpu", help="the benchmark size whose decoders --spec names")
    args = parser.parse_args()
    device = SIZES[args.size]["device"]
    fixture = fixtures.build(SIZES[args.size]["decoders"][args.spec])
    manager = TaskManager(include_path=TASK_DIR, include_defaults=False)
    for label, options in (("ortmodule kernels", None), ("ONNX Runtime's choice (sdpa_kernel 0)", {"sdpa_kernel": 0})):
        model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device=device,
                                                   provider_options=options if device != "cpu" else None)
        shapes(model, label, device)
        for share in ("auto", "true"):
            lm = get_model("ortmodule")(pretrained=model, tokenizer=str(fixture.package_dir), batch_size=32,
                                        share_contexts=share)
            print(f"{label}: lm-eval 400 requests, share_contexts={share}: {lm_eval_seconds(lm, manager):.2f} s",
                  flush=True)
        del model, lm
        if device != "cpu":
            torch.cuda.empty_cache()
    hf = get_model("hf")(pretrained=str(fixture.hf_dir), dtype="bfloat16", device=device, batch_size=32)
    print(f"transformers (lm-eval hf, bf16): lm-eval 400 requests: {lm_eval_seconds(hf, manager):.2f} s", flush=True)


if __name__ == "__main__":
    main()
