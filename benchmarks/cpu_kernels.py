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
`--matmul`: one matmul at SmolLM2's MLP shape (1,024 rows x 576 x 1,536: 8 rows of 128 tokens) in
every precision ONNX Runtime's CPU kernels take, against torch's fp32 and bf16 (AMX where the CPU
has it), 2 threads each, best of 5: what a lower precision could give ortmodule on a CPU. Weights
per output column (int8) or per block of 32 (MatMulNBits); activations per tensor
(`DynamicQuantizeLinear`, ONNX Runtime's dynamic quantization) or per row (each token its own scale,
written out in ONNX ops).

    python benchmarks/cpu_kernels.py --decode 28
    python benchmarks/cpu_kernels.py --forward 8x128
    python benchmarks/cpu_kernels.py --attention
    python benchmarks/cpu_kernels.py --matmul

`--spec NAME` profiles another package than SmolLM2's: a spec of benchmarks/conftest.py or of
ortmodule_dev.fixtures (e.g. `GEMMA4_VL_CPU`, the image workload's Gemma 4; a multimodal package's
decoder is profiled, its prompts text only). `--steps ROWS`: a decode step's time, ortmodule's
against transformers' fp32 on the spec's weights: greedy generate of 1 and of 17 tokens from ROWS
prompts of `--length` tokens, best of 2, the difference over 16 steps. `--read-rate KxN`: how fast a
two-row fp32 matmul (a decode step's shape at batch 2) reads a K x N weight, ONNX Runtime's MatMul
against torch's `F.linear`, over enough copies of the weight that none stays in the cache, beside a
plain copy's rate. `--images WORKLOAD`: an image workload's `score` (benchmarks/test_images.py's
prompts at the CPU size), each of the package's sessions by node.

    python benchmarks/cpu_kernels.py --spec GEMMA4_VL_CPU --decode 2
    python benchmarks/cpu_kernels.py --spec GEMMA4_VL_CPU --steps 2 --length 298
    python benchmarks/cpu_kernels.py --images images_gemma4
    python benchmarks/cpu_kernels.py --read-rate 1536x6144 --read-rate 6144x1536 --read-rate 1536x262144
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


SPEC = fixtures.SMOLLM2  # --spec


def spec_named(name: str) -> fixtures.FixtureSpec:
    import conftest  # benchmarks/conftest.py: the suite's specs

    spec = getattr(conftest, name, None) or getattr(fixtures, name, None)
    if not isinstance(spec, fixtures.FixtureSpec):
        raise SystemExit(f"--spec {name}: no FixtureSpec of that name in benchmarks/conftest.py or "
                         "ortmodule_dev.fixtures")
    return spec


def profiled(prefix: str):
    return OrtModelForCausalLM.from_pretrained(fixtures.build(SPEC).package_dir, session_options=options(prefix))


def step_times(rows: int, length: int) -> None:
    """A decode step's time: ortmodule's and transformers' greedy generate of 1 and of 17 tokens."""
    import transformers

    fixture = fixtures.build(SPEC)
    ids = torch.randint(100, 40000, (rows, length), generator=torch.Generator().manual_seed(0))
    config = transformers.AutoConfig.from_pretrained(fixture.hf_dir)
    auto = transformers.AutoModelForImageTextToText if hasattr(config, "vision_config") else \
        transformers.AutoModelForCausalLM
    for name, load in (("ortmodule", lambda: OrtModelForCausalLM.from_pretrained(fixture.package_dir)),
                       ("transformers", lambda: auto.from_pretrained(fixture.hf_dir, dtype=torch.float32).eval())):
        model = load()
        seconds = {}
        for new in (1, 17):
            best = float("inf")
            for _ in range(2):
                start = time.perf_counter()
                with torch.inference_mode():
                    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                   do_sample=False, pad_token_id=0)
                best = min(best, time.perf_counter() - start)
            seconds[new] = best
        del model
        print(f"{name}: {rows} x {length} tokens, prefill and 1 token {seconds[1] * 1e3:.0f} ms, 17 tokens "
              f"{seconds[17] * 1e3:.0f} ms: {(seconds[17] - seconds[1]) / 16 * 1e3:.1f} ms a step")


def read_rate(shape: str, rows: int = 2) -> None:
    """GB/s at which a `rows`-row fp32 matmul reads its weights, ONNX Runtime's and torch's."""
    from onnx import numpy_helper

    k, n = (int(side) for side in shape.split("x"))
    copies = max(1, math.ceil(400e6 / (4 * k * n)))  # past any last-level cache
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal((k, n), dtype=np.float32) for _ in range(copies)]
    x = rng.standard_normal((rows, k), dtype=np.float32)
    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"]) for i in range(copies)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, k])],
                              [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None) for i in range(copies)],
                              [numpy_helper.from_array(w, f"w{i}") for i, w in enumerate(weights)])
    so = options()
    so.intra_op_num_threads = 2
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 21)])
    session = ort.InferenceSession(model.SerializeToString(), so,
                                   providers=["CPUExecutionProvider"])
    torch.set_num_threads(2)
    transposed, activation = [torch.from_numpy(w.T.copy()) for w in weights], torch.from_numpy(x)

    def torch_linear():
        for w in transposed:
            torch.nn.functional.linear(activation, w)

    gb = 4 * k * n * copies / 1e9
    ours, theirs = (best_ms(fn, repeats=3, calls=5) for fn in (lambda: session.run(None, {"x": x}), torch_linear))
    source = torch.empty(int(100e6))  # 400 MB
    target = torch.empty_like(source)
    copy = best_ms(lambda: target.copy_(source), repeats=3, calls=5)
    print(f"{rows} x {k} x {n} ({copies} weights, {gb:.2f} GB): ONNX Runtime {gb / ours * 1e3:.1f} GB/s, torch "
          f"{gb / theirs * 1e3:.1f} GB/s; a copy {0.8 / copy * 1e3:.1f} GB/s (read + write)")


def node_table(model, last: int, what: str) -> None:
    """The model's last `last` runs under the profiler: their time by node, the layers summed, with
    the FLOP rate of each matmul."""
    events_table(json.loads(Path(model.decoder.session.ort_session.end_profiling()).read_text()), last, what)


def events_table(events: list, last: int, what: str) -> None:
    """`node_table` from one session's profile."""
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "Session"
                  and e["name"] == "model_run")[-last:]
    by_node, flops = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
            continue
        if not any(start <= e["ts"] <= end for start, end in runs):
            continue
        node = re.sub(r"layers\.\d+", "layers.N", e["name"][: -len("_kernel_time")])
        node = re.sub(r"_node_\d+", "", node)  # mobius-onnx numbers each layer's nodes apart
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


def images_profile(workload: str) -> None:
    """The image workload's `score` (benchmarks/test_images.py's prompts, the CPU size) twice under the
    profiler: the second call's runs of each of the package's sessions (vision, embedding, decoder)."""
    import gc

    import conftest
    import test_images
    import transformers

    settings = conftest.SIZES["cpu"][workload]
    fixture = fixtures.build(settings["spec"])
    folder = Path(tempfile.mkdtemp())
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, session_options=options(str(folder / "ort")))
    given, _ = test_images.prompts(fixture, transformers.AutoConfig.from_pretrained(fixture.hf_dir), settings, "cpu")
    with torch.inference_mode():
        for call in range(2):
            start = time.perf_counter()
            model(**given, cont_len=settings["keep"])
            print(f"score, call {call + 1}: {time.perf_counter() - start:.2f} s")
    del model
    gc.collect()  # each session writes its profile as it closes
    for path in sorted(folder.glob("*.json")):
        events = json.loads(path.read_text())
        runs = sorted(e["ts"] for e in events if e.get("cat") == "Session" and e["name"] == "model_run")
        if runs:
            # the second call's runs: as many as the first call made (a session may run once at load)
            events_table(events, len(runs) // 2, f"{path.name}, the second call")


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


MATMUL = (1024, 576, 1536)  # rows, in, out: SmolLM2's MLP up projection on 8 x 128 tokens


def _matmul_ways(w: np.ndarray) -> dict:
    """ONNX Runtime's ways to compute x @ w on a CPU: (nodes, initializers, input dtype) each."""
    from onnx import numpy_helper

    k, n = w.shape
    scale = np.abs(w).max(0) / 127
    w8 = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
    const = {"w": w, "w16": w.astype(np.float16), "w8": w8, "scale": scale.astype(np.float32),
             "axes": np.array([1], np.int64), "c127": np.array(127, np.float32),
             "c128": np.array(128, np.float32), "zp": np.array(128, np.uint8), "one": np.array(1, np.float32)}
    per_row = [helper.make_node("Abs", ["x"], ["ax"]), helper.make_node("ReduceMax", ["ax", "axes"], ["mx"]),
               helper.make_node("Div", ["mx", "c127"], ["sx"]), helper.make_node("Div", ["x", "sx"], ["xs"]),
               helper.make_node("Add", ["xs", "c128"], ["xz"]), helper.make_node("Round", ["xz"], ["xr"]),
               helper.make_node("Cast", ["xr"], ["xq"], to=TensorProto.UINT8),
               helper.make_node("MatMulIntegerToFloat", ["xq", "w8", "one", "scale", "zp"], ["y"],
                                domain="com.microsoft"), helper.make_node("Mul", ["y", "sx"], ["out"])]
    ways = {"fp32 MatMul": ([helper.make_node("MatMul", ["x", "w"], ["out"])], ["w"], TensorProto.FLOAT),
            "fp16 MatMul": ([helper.make_node("MatMul", ["x", "w16"], ["out"])], ["w16"], TensorProto.FLOAT16),
            "int8 weights, activations per tensor (u8 x s8)": (
                [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
                 helper.make_node("MatMulIntegerToFloat", ["xq", "w8", "xs", "scale", "xz"], ["out"],
                                  domain="com.microsoft")], ["w8", "scale"], TensorProto.FLOAT),
            "int8 weights, activations per row (u8 x s8)": (
                per_row, ["w8", "scale", "axes", "c127", "c128", "zp", "one"], TensorProto.FLOAT)}
    for bits in (8, 4):
        blocks = w.T.reshape(n, k // 32, 32)
        middle = 2 ** (bits - 1)
        block_scale = np.abs(blocks).max(-1) / (middle - 1)
        q = np.clip(np.round(blocks / block_scale[..., None]) + middle, 0, 2 ** bits - 1).astype(np.uint8)
        const[f"b{bits}"] = q if bits == 8 else (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
        const[f"s{bits}"] = block_scale.astype(np.float32).reshape(-1)
        for level in (0, 4):
            node = helper.make_node("MatMulNBits", ["x", f"b{bits}", f"s{bits}"], ["out"], domain="com.microsoft",
                                    K=k, N=n, bits=bits, block_size=32, accuracy_level=level)
            ways[f"MatMulNBits, {bits}-bit, accuracy_level {level}"] = ([node], [f"b{bits}", f"s{bits}"],
                                                                         TensorProto.FLOAT)
    return {name: (nodes, [numpy_helper.from_array(const[c], c) for c in used], dtype)
            for name, (nodes, used, dtype) in ways.items()}


def matmul_table() -> None:
    rows, k, n = MATMUL
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    exact = x.astype(np.float64) @ w.astype(np.float64)
    flop = 2 * rows * k * n
    print(f"| way ({rows} x {k} x {n}) | ms | G(FL)OP/s | largest error / largest output |")
    print("|---|---|---|---|")
    for name, (nodes, initializers, dtype) in _matmul_ways(w).items():
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", dtype, [rows, k])],
                                  [helper.make_tensor_value_info("out", dtype, None)], initializers)
        model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 21),
                                                                       helper.make_opsetid("com.microsoft", 1)])
        so = options()
        so.intra_op_num_threads = 2
        session = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        feed = {"x": x.astype(np.float16) if dtype == TensorProto.FLOAT16 else x}
        ms = best_ms(lambda s=session, f=feed: s.run(None, f))
        error = np.abs(session.run(None, feed)[0].astype(np.float64) - exact).max() / np.abs(exact).max()
        print(f"| ONNX Runtime, {name} | {ms:.2f} | {flop / ms / 1e6:.0f} | {error:.1e} |")
    torch.set_num_threads(2)
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.from_numpy(x).to(dtype), torch.from_numpy(w).to(dtype)
        ms = best_ms(lambda a=a, b=b: a @ b)
        error = np.abs((a @ b).double().numpy() - exact).max() / np.abs(exact).max()
        print(f"| torch, {str(dtype).split('.')[1]} | {ms:.2f} | {flop / ms / 1e6:.0f} | {error:.1e} |")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--decode", type=int, metavar="ROWS", help="profile decode steps of ROWS rows")
    parser.add_argument("--forward", metavar="BATCHxLENGTH", help="profile forward passes (cont_len=4)")
    parser.add_argument("--attention", action="store_true", help="one layer's attention, kernel against kernel")
    parser.add_argument("--matmul", action="store_true", help="one matmul in every precision ONNX Runtime's CPU takes")
    parser.add_argument("--images", metavar="WORKLOAD", help="profile an image workload's score (images_gemma4, ...)")
    parser.add_argument("--spec", help="profile this spec's package (benchmarks/conftest.py's or fixtures')")
    parser.add_argument("--steps", type=int, metavar="ROWS", help="a decode step's time, ortmodule and transformers")
    parser.add_argument("--length", type=int, default=40, help="with --steps: the prompts' tokens")
    parser.add_argument("--read-rate", action="append", default=[], metavar="KxN",
                        help="a two-row fp32 matmul's read rate of a K x N weight, ONNX Runtime's and torch's")
    args = parser.parse_args()
    if not (args.decode or args.forward or args.attention or args.matmul or args.steps or args.read_rate
            or args.images):
        parser.error("say --decode ROWS, --forward BATCHxLENGTH, --attention, --matmul, --steps ROWS, "
                     "--read-rate KxN or --images WORKLOAD")
    if args.spec:
        global SPEC
        SPEC = spec_named(args.spec)
    if args.steps:
        step_times(args.steps, args.length)
    for shape in args.read_rate:
        read_rate(shape)
    if args.images:
        images_profile(args.images)
    if args.decode:
        decode_profile(args.decode)
    if args.forward:
        forward_profile(args.forward)
    if args.attention:
        attention_table()
    if args.matmul:
        matmul_table()


if __name__ == "__main__":
    main()
