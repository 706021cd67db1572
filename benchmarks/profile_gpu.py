"""Where the time of GPU scoring goes: one lm-eval-shaped loglikelihood batch (32 rows of ~200
tokens, 4 continuation tokens each) through ortmodule and through transformers (bf16, sdpa) on the
same weights, profiled with torch's profiler, which records ONNX Runtime's kernels as well (CUPTI
sees every kernel in the process). Prints wall time per batch, the summed kernel time (the rest is
the host: launches, Python, syncs), and the top kernels of each.

    python benchmarks/profile_gpu.py [--spec qwen3-0.6b-bf16] [--batch 32] [--length 200]
        [--extra-option KEY=VALUE ...] [--only ortmodule]

`--extra-option` exports a variant of the package with that model-builder option (repeatable, e.g.
fuse_mlp_gate_up=true, fuse_qkv=false), so that graph options can be measured one at a time;
`of peak` counts 2 x the decoder's weights x the real tokens over the data sheet's dense bf16 peak.
"""

import argparse
import dataclasses
import re
import sys
import time
from pathlib import Path

import torch
from conftest import GPU_DATASHEET, SIZES
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

from ortmodule import OrtModelForCausalLM, scoring

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's dev helpers: ortmodule_dev
from ortmodule_dev import fixtures  # noqa: E402


def timed(fn, repeats=10):
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


# Kernel names -> the parts of a decoder the profile names (first match wins).
CATEGORIES = [
    ("rotary + KV append", re.compile(r"rope|rotary|append|unpack|concatnewtopast", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|softmax|xqa|mha", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|sm\d+_|cublas|matmul|ampere_|hopper", re.I)),
    ("norms", re.compile(r"layernorm|layer_norm|rmsnorm|skiplayer", re.I)),
    ("element-wise", re.compile(r"elementwise|binary|unary|quickgelu|gelu|silu|sigmoid|mul|add|cast|split|"
                                r"copy|fill|where|expand|gather|slice|concat|transpose", re.I)),
]


def kernel_table(fn, rows=12):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    total = sum(e.self_device_time_total for e in events) / 1e3
    return total, events.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=70) + \
        "\n" + category_shares(events)


def category_shares(events) -> str:
    """The device time of the kernels by part of the model (CATEGORIES), as shares of their sum."""
    parts: dict[str, float] = {}
    for e in events:
        if getattr(e, "device_type", None) != DeviceType.CUDA or not e.self_device_time_total:
            continue
        label = next((name for name, pattern in CATEGORIES if pattern.search(e.key)), "other")
        parts[label] = parts.get(label, 0.0) + e.self_device_time_total
    kernels = sum(parts.values()) or 1.0
    ranked = sorted(parts.items(), key=lambda kv: -kv[1])
    return "kernel time by part: " + ", ".join(
        f"{name} {100 * t / kernels:.0f}% ({t / 1e3:.2f} ms)" for name, t in ranked)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", default="qwen3-0.6b-bf16")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=200)
    parser.add_argument("--extra-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--only", choices=["ortmodule", "transformers"])
    args = parser.parse_args()
    spec = SIZES["gpu"]["decoders"][args.spec]
    if args.extra_option:
        options = dict(spec.extra_options) | dict(item.split("=", 1) for item in args.extra_option)
        spec = dataclasses.replace(spec, extra_options=tuple(sorted(options.items())))
    fixture = fixtures.build(spec)
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device="cuda")
    name = torch.cuda.get_device_name()
    peak = next((flops for key, (flops, _) in GPU_DATASHEET.items() if key in name), None)
    print(f"{name}; package {fixture.package_dir.name}, builder options {dict(spec.extra_options) or 'default'}")
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.length - 40, args.length + 1, (args.batch,), generator=gen)
    width = int(lengths.max())
    ids = torch.randint(4, 32000, (args.batch, width), generator=gen)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    starts = [int(n) - 5 for n in lengths]
    targets = [[int(t) for t in ids[i, s + 1 : s + 5]] for i, s in enumerate(starts)]

    def ours():
        return scoring.loglikelihood(model, ids, mask, starts, targets)

    @torch.inference_mode()
    def theirs():
        logits = hf(input_ids=ids.cuda(), attention_mask=mask.cuda()).logits
        rows = torch.arange(args.batch).repeat_interleave(4).cuda()
        cols = torch.tensor([s + i for s in starts for i in range(4)]).cuda()
        lp = torch.log_softmax(logits[rows, cols].float(), -1)
        return lp.gather(1, torch.tensor([t for row in targets for t in row]).cuda()[:, None]).sum().item()

    tokens = int(lengths.sum())
    weights = model.num_parameters(exclude_embeddings=True)
    runs = {"ortmodule": ours, "transformers": theirs}
    for label, fn in runs.items():
        if args.only and label != args.only:
            continue
        if label == "transformers":
            hf = AutoModelForCausalLM.from_pretrained(fixture.hf_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
            hf = hf.to("cuda").eval()
        seconds = timed(fn)
        kernel_ms, table = kernel_table(fn)
        share = f", {100 * 2 * weights * tokens / seconds / peak:.1f}% of the dense bf16 peak" if peak else ""
        print(f"== {label}: {seconds * 1e3:.2f} ms per batch of {args.batch} rows ({tokens} tokens, "
              f"{tokens / seconds:.0f} tokens/s{share}); summed device time {kernel_ms:.2f} ms "
              f"({100 * kernel_ms / (seconds * 1e3):.0f}% of the wall time)")
        print(table)


if __name__ == "__main__":
    main()
