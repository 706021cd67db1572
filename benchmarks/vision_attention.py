"""Gemma 3's vision tower on a CPU with its attention as exported (`MatMul`, `Softmax`, `MatMul` over
every pair of patches) and rewritten into ONNX Runtime's fused `com.microsoft::MultiHeadAttention`:
the time of one image through the tower's graph, each way in a process of its own (both sessions at
once take more memory than a 24 GB machine has at 896 x 896), and the last layer's attention output
of the two (added as a graph output). The suite's Gemma 3 package (benchmarks/conftest.py,
`GEMMA3_VL_CPU`: Gemma-3-4B's SigLIP tower and projector, random weights), or with `--small` the tiny
fixture's.

    python benchmarks/vision_attention.py [--small] [--threads 2]

The rewrite matches the pattern transformers' export leaves per layer: the biased `q_proj` output ->
`Reshape` `[B, S, -1, D]` -> `Transpose` `[0, 2, 1, 3]` -> `Mul` by a constant (`k_proj`'s the same
with `Transpose` `[0, 2, 3, 1]`), `MatMul` -> `Softmax` -> `MatMul` with `v_proj`'s -> `Reshape` ->
`Transpose` `[0, 2, 1, 3]` -> `Reshape` `[B, S, H x D]`, which becomes `MultiHeadAttention(q, k, v,
num_heads=H, scale=the two constants' product)`.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ortmodule_dev
from conftest import GEMMA3_VL_CPU  # noqa: E402

from ortmodule import runtime  # noqa: E402
from ortmodule_dev import fixtures  # noqa: E402


def constant(value: ir.Value) -> np.ndarray | None:
    node = value.producer()
    if node is not None and node.op_type == "Constant":
        return node.attributes["value"].value.numpy()
    return value.const_value.numpy() if value.const_value is not None else None


def projection(value: ir.Value, perm: tuple) -> tuple[ir.Value, float, ir.Node] | None:
    """`value` as `Transpose(Reshape(x), perm)`, scaled by a constant or not: (x, scale, the Reshape)."""
    scale, node = 1.0, value.producer()
    if node is not None and node.op_type == "Mul":
        found = constant(node.inputs[1])
        if found is None or found.size != 1:
            return None
        scale, node = float(found.reshape(-1)[0]), node.inputs[0].producer()
    if node is None or node.op_type != "Transpose" or tuple(node.attributes["perm"].value) != perm:
        return None
    reshape = node.inputs[0].producer()
    return (reshape.inputs[0], scale, reshape) if reshape is not None and reshape.op_type == "Reshape" else None


def only_use(value: ir.Value, op_type: str) -> ir.Node | None:
    uses = [use.node for use in value.uses() if use.node.op_type != "Shape"]
    return uses[0] if len(uses) == 1 and uses[0].op_type == op_type else None


def heads(reshape: ir.Node) -> int | None:
    """H of a `[B, S, H or -1, D]` reshape (a Concat of its dimensions); with -1, the projection's width / D."""
    concat = reshape.inputs[1].producer()
    if concat is None or concat.op_type != "Concat" or len(concat.inputs) != 4:
        return None
    h, d = (constant(concat.inputs[i]) for i in (2, 3))
    if h is None or d is None:
        return None
    h, d = int(h.reshape(-1)[0]), int(d.reshape(-1)[0])
    if h > 0:
        return h
    matmuls = [v.producer() for v in reshape.inputs[0].producer().inputs if v.producer() is not None]
    weights = [m.inputs[1] for m in matmuls if m.op_type == "MatMul" and m.inputs[1].shape is not None]
    return int(weights[0].shape[-1]) // d if weights else None


def rewrite(model: ir.Model) -> int:
    """Each layer's attention into `MultiHeadAttention`; the count rewritten."""
    graph, count = model.graph, 0
    for softmax in [n for n in graph if n.op_type == "Softmax"]:
        scores, weighted = softmax.inputs[0].producer(), only_use(softmax.outputs[0], "MatMul")
        if scores is None or scores.op_type != "MatMul" or weighted is None:
            continue
        q, k = projection(scores.inputs[0], (0, 2, 1, 3)), projection(scores.inputs[1], (0, 2, 3, 1))
        v = projection(weighted.inputs[1], (0, 2, 1, 3))
        after = only_use(weighted.outputs[0], "Reshape")
        transpose = only_use((after or weighted).outputs[0], "Transpose")
        merged = transpose and only_use(transpose.outputs[0], "Reshape")
        if None in (q, k, v) or v[1] != 1.0 or not merged or tuple(transpose.attributes["perm"].value) != (0, 2, 1, 3):
            continue
        num_heads = heads(q[2])
        if not num_heads:
            continue
        node = ir.node("MultiHeadAttention", [q[0], k[0], v[0]], domain="com.microsoft",
                       attributes={"num_heads": num_heads, "scale": q[1] * k[1]}, name=softmax.name + "/fused")
        graph.insert_before(merged, node)
        merged.outputs[0].replace_all_uses_with(node.outputs[0])
        count += 1
    model.opset_imports.setdefault("com.microsoft", 1)
    return count


def run(path: str, fused: bool, threads: int, side: int) -> dict:
    """One way's graph bytes (the last layer's attention output added), session, warm-up and one clocked run."""
    source = Path(path)
    model = ir.serde.deserialize_model(onnx.load(source, load_external_data=False))
    count = rewrite(model) if fused else 0
    model.graph.outputs.append([n for n in model.graph if n.name.endswith("self_attn/out_proj/Add")][-1].outputs[0])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry(runtime.EXTERNAL_DATA_FOLDER, str(source.parent))
    session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    pixels = np.random.default_rng(0).standard_normal((1, 3, side, side)).astype(np.float32)
    feed = {session.get_inputs()[0].name: pixels}
    session.run(None, feed)
    start = time.perf_counter()
    probe = session.run(None, feed)[-1]
    seconds = time.perf_counter() - start
    with tempfile.NamedTemporaryFile(suffix=".npy", delete=False) as f:
        np.save(f, probe)
    return {"seconds": seconds, "rewritten": count, "probe": f.name}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="the tiny Gemma 3 fixture's tower")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--way", choices=["unfused", "fused"], help=argparse.SUPPRESS)  # one way, in a child
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--side", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.way:
        print(json.dumps(run(args.path, args.way == "fused", args.threads, args.side)))
        return
    spec = fixtures.FixtureSpec("gemma3_vl") if args.small else GEMMA3_VL_CPU
    package = fixtures.build(spec).package_dir
    path = package / json.loads((package / "genai_config.json").read_text())["model"]["vision"]["filename"]
    side = onnx.load(path, load_external_data=False).graph.input[0].type.tensor_type.shape.dim[-1].dim_value
    results = {}
    for way in ("unfused", "fused"):
        done = subprocess.run([sys.executable, __file__, "--way", way, "--path", str(path), "--side", str(side),
                               "--threads", str(args.threads)], capture_output=True, text=True, check=True)
        results[way] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{way}: {results[way]['seconds']:.2f} s for one {side} x {side} image"
              + (f" ({results[way]['rewritten']} layers rewritten)" if way == "fused" else ""))
    probes = [np.load(results[way]["probe"]) for way in ("unfused", "fused")]
    for way in results:
        Path(results[way]["probe"]).unlink()
    print(f"last layer's attention output: largest difference {np.abs(probes[0] - probes[1]).max():.1e} "
          f"(largest value {np.abs(probes[0]).max():.3g})")


if __name__ == "__main__":
    main()
