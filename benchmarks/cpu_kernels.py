"""Where a CPU's time goes in ONNX Runtime's kernels, for the levers left on a CPU.

`--decode ROWS`: greedy generation of 64 tokens from ROWS prompts of 40 tokens on the real
SmolLM2-135M fp32 package (the demo's; a continuous batch of the server runs such steps), under
ONNX Runtime's profiler: each decode step's time by node (the 30 layers summed), with the FLOP rate of
the matmuls.

`--forward 8x128`: the same for forward passes of 8 rows of 128 tokens with `cont_len=4` (the
benchmark suite's forward shape on a CPU): what a prefill's time is made of.

`--attention`: one layer's attention at SmolLM2's heads (9 query heads, 3 KV heads, head size 64),
ONNX Runtime's kernels against torch's `scaled_dot_product_attention` on the same shapes, 2 threads
each, best of 5: prompts without a past (8 x 128, 4 x 512: what scoring's padded rows run), a
chunk of 256 tokens over a past (chunked.py's long rows), and one decode step of 28 rows over a
past of 70 (GroupQueryAttention with the KV buffers shared, as ortmodule binds them). ONNX Runtime's
forms: GroupQueryAttention (rotary inside, as the package runs it), the grouped query heads folded
into the rows of a MatMul / Softmax / MatMul, and ONNX's `Attention` (opset 23, `is_causal`).

    python benchmarks/cpu_kernels.py --decode 28
    python benchmarks/cpu_kernels.py --forward 8x128
    python benchmarks/cpu_kernels.py --attention
"""

import argparse
import collections
import json
import math
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

from ortmodule import OrtModelForCausalLM, runtime

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's dev helpers: ortmodule_dev
from ortmodule_dev import fixtures  # noqa: E402

HEADS, KV_HEADS, HEAD = 9, 3, 64  # SmolLM2-135M's attention


def options(profile_prefix: str | None = None) -> ort.SessionOptions:
    """ortmodule's own session settings (runtime.make_session's), optionally profiled."""
    so = ort.SessionOptions()
    so.log_severity_level = 3
    for key, value in runtime.SPINNING:
        so.add_session_config_entry(key, value)
    if profile_prefix:
        so.enable_profiling, so.profile_file_prefix = True, profile_prefix
    return so


def best_ms(fn, repeats: int = 5, calls: int = 20) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def profiled(prefix: str):
    return OrtModelForCausalLM.from_pretrained(fixtures.build(fixtures.SMOLLM2).package_dir,
                                               session_options=options(prefix))


def node_table(model, last: int, what: str) -> None:
    """The model's last `last` runs under the profiler: their time by node, the layers summed, with
    the FLOP rate of each matmul."""
    events = json.loads(Path(model.decoder.session.ort_session.end_profiling()).read_text())
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "Session"
                  and e["name"] == "model_run")[-last:]
    by_node, flops = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
            continue
        if not any(start <= e["ts"] <= end for start, end in runs):
            continue
        node = re.sub(r"layers\.\d+", "layers.N", e["name"][: -len("_kernel_time")])
        by_node[node] += e["dur"]
        given, made = ([*(shape or [{}])[0].values()] for shape in (e["args"].get("input_type_shape"),
                                                                     e["args"].get("output_type_shape")))
        if e["args"].get("op_name") == "MatMul" and given and made:  # 2 x rows x K x N
            flops[node] += 2 * math.prod(given[0][:-1]) * given[0][-1] * made[0][-1]
    run_ms = sum(end - start for start, end in runs) / len(runs) / 1e3
    total = sum(by_node.values())
    print(f"{what}: {run_ms:.1f} ms a run inside ONNX Runtime, kernels {total / len(runs) / 1e3:.1f} ms")
    for node, us in by_node.most_common(12):
        line = f"{node:50s} {us / len(runs) / 1e3:7.2f} ms a run {100 * us / total:5.1f}%"
        print(line + (f"  {flops[node] / us / 1e3:.0f} GFLOP/s" if flops[node] else ""))


def decode_profile(rows: int) -> None:
    model = profiled(str(Path(tempfile.mkdtemp()) / "ort"))
    ids = torch.randint(100, 40000, (rows, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model.generate(ids[:, :8], attention_mask=torch.ones_like(ids[:, :8]), max_new_tokens=4, do_sample=False)
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, min_new_tokens=64, do_sample=False)
    # the second generation's 63 decode steps (its first token comes from the prompts' prefill)
    node_table(model, 63, f"{rows} rows, 63 decode steps")


def forward_profile(shape: str) -> None:
    batch, length = (int(n) for n in shape.split("x"))
    model = profiled(str(Path(tempfile.mkdtemp()) / "ort"))
    ids = torch.randint(100, 40000, (batch, length), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for _ in range(6):
            model(ids, cont_len=4)
    node_table(model, 5, f"forward {batch} x {length}, cont_len=4, 5 runs after one")


def _model(nodes, inputs, opset: int = 21, outputs=("out",)):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                    helper.make_opsetid("com.microsoft", 1)], ir_version=10)
    return ort.InferenceSession(model.SerializeToString(), options(), providers=["CPUExecutionProvider"])


def gqa_ms(batch: int, new: int, past: int, layers: int = 1) -> float:
    """GroupQueryAttention as the package runs it: packed QKV, rotary inside, the KV buffers shared;
    with `layers`, the time of one run over each of that many buffers in turn (as a step meets them)."""
    total, f = past + new, TensorProto.FLOAT
    node = helper.make_node("GroupQueryAttention", ["qkv", "", "", "pk", "pv", "seqlens", "total", "cos", "sin"],
                            ["out", "pk_out", "pv_out"], domain="com.microsoft", num_heads=HEADS,
                            kv_num_heads=KV_HEADS, do_rotary=1)
    width = (HEADS + 2 * KV_HEADS) * HEAD
    session = _model([node], [("qkv", f, [batch, new, width]), ("pk", f, [batch, KV_HEADS, total, HEAD]),
                              ("pv", f, [batch, KV_HEADS, total, HEAD]), ("seqlens", TensorProto.INT32, [batch]),
                              ("total", TensorProto.INT32, []), ("cos", f, [total, HEAD // 2]),
                              ("sin", f, [total, HEAD // 2])], outputs=("out", "pk_out", "pv_out"))
    rng = np.random.default_rng(0)
    feeds = {"qkv": rng.standard_normal((batch, new, width), np.float32),
             "seqlens": np.full(batch, total - 1, np.int32), "total": np.array(total, np.int32),
             "cos": rng.standard_normal((total, HEAD // 2), np.float32),
             "sin": rng.standard_normal((total, HEAD // 2), np.float32)}
    bindings = []
    for _ in range(layers):
        binding = session.io_binding()
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        for name in ("pk", "pv"):
            buffer = ort.OrtValue.ortvalue_from_numpy(rng.standard_normal((batch, KV_HEADS, total, HEAD), np.float32))
            binding.bind_ortvalue_input(name, buffer)
            binding.bind_ortvalue_output(name + "_out", buffer)
        binding.bind_output("out")
        bindings.append(binding)
    return best_ms(lambda: [session.run_with_iobinding(b) for b in bindings], calls=max(1, 20 // layers)) / layers


def folded_ms(batch: int, new: int, past: int) -> float:
    """The grouped query heads folded into a MatMul's rows: [batch, kv heads, group x new, total]."""
    total, group, f = past + new, HEADS // KV_HEADS, TensorProto.FLOAT
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]), helper.make_node("Mul", ["s", "scale"], ["ss"]),
             helper.make_node("Add", ["ss", "bias"], ["sb"]), helper.make_node("Softmax", ["sb"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["out"])]
    session = _model(nodes, [("q", f, [batch, KV_HEADS, group * new, HEAD]), ("k", f, [batch, KV_HEADS, total, HEAD]),
                             ("v", f, [batch, KV_HEADS, total, HEAD]), ("bias", f, [group * new, total]),
                             ("scale", f, [])])
    rng = np.random.default_rng(0)
    causal = np.triu(np.full((new, total), -1e9, np.float32), past + 1)
    feeds = {"q": rng.standard_normal((batch, KV_HEADS, group * new, HEAD), np.float32),
             "k": rng.standard_normal((batch, KV_HEADS, total, HEAD), np.float32),
             "v": rng.standard_normal((batch, KV_HEADS, total, HEAD), np.float32),
             "bias": np.tile(causal, (group, 1)), "scale": np.array(HEAD**-0.5, np.float32)}
    return best_ms(lambda: session.run(None, feeds))


def onnx_attention_ms(batch: int, new: int) -> float:
    """ONNX's Attention (opset 23) over the rows' own tokens, causal (the prefill graph's form)."""
    f = TensorProto.FLOAT
    node = helper.make_node("Attention", ["q", "k", "v"], ["out"], is_causal=1)
    session = _model([node], [("q", f, [batch, HEADS, new, HEAD]), ("k", f, [batch, KV_HEADS, new, HEAD]),
                              ("v", f, [batch, KV_HEADS, new, HEAD])], opset=23)
    rng = np.random.default_rng(0)
    feeds = {name: rng.standard_normal((batch, heads, new, HEAD), np.float32)
             for name, heads in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS))}
    return best_ms(lambda: session.run(None, feeds))


def torch_ms(batch: int, new: int, past: int) -> float:
    total = past + new
    q, k, v = (torch.randn(batch, heads, n, HEAD) for heads, n in ((HEADS, new), (KV_HEADS, total), (KV_HEADS, total)))
    mask = None if not past else torch.ones(new, total, dtype=torch.bool).tril(past)
    attend = torch.nn.functional.scaled_dot_product_attention
    with torch.inference_mode():
        return best_ms(lambda: attend(q, k, v, attn_mask=mask, is_causal=not past, enable_gqa=True))


def attention_table() -> None:
    torch.set_num_threads(2)
    print("| shape | GroupQueryAttention | MatMul / Softmax / MatMul, heads folded | ONNX Attention | torch sdpa |")
    print("|---|---|---|---|---|")
    for label, batch, new, past in [("prompts 8 x 128", 8, 128, 0), ("prompts 4 x 512", 4, 512, 0),
                                    ("a chunk of 256 over 1,024", 1, 256, 1024),
                                    ("a chunk of 256 over 4,096", 1, 256, 4096),
                                    ("a decode step, 28 rows over 70", 28, 1, 70)]:
        onnx_attention = f"{onnx_attention_ms(batch, new):.2f} ms" if not past else ""
        print(f"| {label} | {gqa_ms(batch, new, past):.2f} ms | {folded_ms(batch, new, past):.2f} ms | "
              f"{onnx_attention} | {torch_ms(batch, new, past):.2f} ms |")
    print(f"| a decode step as above, over 30 layers' buffers in turn | {gqa_ms(28, 1, 70, layers=30):.2f} ms a layer "
          "| | | |")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--decode", type=int, metavar="ROWS", help="profile decode steps of ROWS rows")
    parser.add_argument("--forward", metavar="BATCHxLENGTH", help="profile forward passes (cont_len=4)")
    parser.add_argument("--attention", action="store_true", help="one layer's attention, kernel against kernel")
    args = parser.parse_args()
    if not (args.decode or args.forward or args.attention):
        parser.error("say --decode ROWS, --forward BATCHxLENGTH or --attention")
    if args.decode:
        decode_profile(args.decode)
    if args.forward:
        forward_profile(args.forward)
    if args.attention:
        attention_table()


if __name__ == "__main__":
    main()
