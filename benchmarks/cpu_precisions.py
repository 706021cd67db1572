"""Lower precision on a CPU: what each way gives against the fp32 package, in speed and in numbers.

On a CPU with AMX (Intel Xeon 4th generation on), torch runs bf16 matmuls several times faster
than fp32 ones, and lm-eval's `hf` backend runs a bf16 checkpoint in bf16 by default (`dtype`
auto). ONNX Runtime has no bf16 matmul on x86 CPUs; its one faster path there is int8 (its int8
GEMM takes AMX). This compares, on the real SmolLM2-135M-Instruct and 8 x 128 tokens of English
prose and code (the sources of the standard library's `os`, `json` and `collections`): ortmodule
on the fp32 package, ortmodule on ONNX Runtime's dynamic int8 quantization of that package (`quantize_dynamic`:
per-channel int8 weights, each activation quantized per tensor at run time), and transformers in
fp32 and in bf16. Per way: a forward's time (`cont_len=4` / `logits_to_keep=4`, best of 5) and,
against the fp32 package's log-probabilities at every position, the mean and largest difference
in the next token's log-probability, the mean KL divergence and the share of positions with the
same greedy token. Last, what int8 with each activation row (token) quantized on its own would
compute (`cpu_kernels.py --matmul`: ONNX Runtime's u8 x s8 kernel runs such a matmul about 3x its
fp32 one, written in ONNX ops): transformers in fp32 with every layer's weights rounded to int8 per
output channel and every linear layer's input to int8 per row (simulated, so not timed).

    python benchmarks/cpu_precisions.py
"""

import collections
import inspect
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from onnxruntime.quantization import QuantType, quantize_dynamic

from ortmodule import OrtModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's dev helpers: ortmodule_dev
from ortmodule_dev import fixtures  # noqa: E402


def int8_package(package: Path) -> Path:
    """A copy of the package whose MatMuls ONNX Runtime's dynamic quantization made int8."""
    folder = Path(tempfile.mkdtemp()) / "package"
    folder.mkdir()
    for item in package.iterdir():
        if item.is_file() and not item.name.startswith("model.onnx"):
            (folder / item.name).write_bytes(item.read_bytes())
    quantize_dynamic(package / "model.onnx", folder / "model.onnx", per_channel=True, weight_type=QuantType.QInt8,
                     op_types_to_quantize=["MatMul"], use_external_data_format=True,
                     extra_options={"MatMulConstBOnly": True})
    return folder


def int8_rows_simulated(model: torch.nn.Module) -> torch.nn.Module:
    """`model` (transformers, fp32) computing as an int8 graph with activations per row would: every
    linear layer but the LM head with its weights rounded to int8 per output channel and its input
    rounded to int8 per row (each token its own scale), at run time."""
    def per_row(module, args):
        x = args[0]
        scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
        return ((x / scale).round().clamp(-128, 127) * scale,)

    for name, layer in model.named_modules():
        if isinstance(layer, torch.nn.Linear) and name != "lm_head":
            scale = layer.weight.abs().amax(1, keepdim=True) / 127
            layer.weight.data = (layer.weight / scale).round().clamp(-127, 127) * scale
            layer.register_forward_pre_hook(per_row)
    return model


def prose(tokenizer, rows: int, length: int) -> torch.Tensor:
    text = "".join(inspect.getsource(module) for module in (os, json, collections))
    return tokenizer(text, return_tensors="pt").input_ids[0, : rows * length].reshape(rows, length)


def best_seconds(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@torch.inference_mode()
def main():
    torch.set_num_threads(2)
    fixture = fixtures.build(fixtures.SMOLLM2)
    tokenizer = transformers.AutoTokenizer.from_pretrained(fixture.hf_dir)
    ids = prose(tokenizer, 8, 128)
    ways = {
        "ortmodule, fp32 package": (OrtModelForCausalLM.from_pretrained(fixture.package_dir), "cont_len"),
        "ortmodule, int8 (dynamic quantization of it)": (
            OrtModelForCausalLM.from_pretrained(int8_package(fixture.package_dir)), "cont_len"),
        "transformers fp32": (transformers.AutoModelForCausalLM.from_pretrained(fixture.hf_dir, dtype=torch.float32),
                              "logits_to_keep"),
        "transformers bf16": (transformers.AutoModelForCausalLM.from_pretrained(fixture.hf_dir, dtype=torch.bfloat16),
                              "logits_to_keep"),
        "int8, activations per row (simulated in transformers)": (int8_rows_simulated(
            transformers.AutoModelForCausalLM.from_pretrained(fixture.hf_dir, dtype=torch.float32)), None),
    }
    reference = None
    print(f"{torch.get_num_threads()} threads; {ids.shape[0]} x {ids.shape[1]} tokens of prose")
    print("| way | forward ms | next-token log-prob difference, mean / largest | KL from fp32 | same greedy token |")
    print("|---|---|---|---|---|")
    for name, (model, keep) in ways.items():
        logprobs = torch.log_softmax(model(ids).logits.float(), -1)
        seconds = best_seconds(lambda: model(ids, **{keep: 4})) if keep else None  # noqa: B023
        if reference is None:
            reference = logprobs
        target = ids[:, 1:, None]
        diff = (logprobs[:, :-1].gather(2, target) - reference[:, :-1].gather(2, target)).abs()
        kl = (reference.exp() * (reference - logprobs)).sum(-1).mean()
        same = (logprobs.argmax(-1) == reference.argmax(-1)).float().mean()
        timed = f"{seconds * 1e3:.0f}" if seconds is not None else "(not timed)"
        print(f"| {name} | {timed} | {diff.mean():.4f} / {diff.max():.3f} | {kl:.4f} | {same:.1%} |")


if __name__ == "__main__":
    main()
