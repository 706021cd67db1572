"""An experiment for issue 26 (docs/measurements.md, session 29): a prefill graph whose attention is
ONNX's `Attention` op instead of ONNX Runtime's `GroupQueryAttention`.

On an H200, GroupQueryAttention's prologue kernel (`UnpackRoPEAppend`: the query/key norms, rotary
and the KV write) took 21% of an MMLU-shaped batch's device time, bound by launching one 16-thread
block per (token, head, row). This rewrite replaces every GroupQueryAttention node of a decoder by
the same computation in other ops, for a prefill from an empty cache:

- the query/key norms (Qwen3's, fused into GQA in a CUDA export) as `SimplifiedLayerNormalization`
  over each head, the rotary as ONNX Runtime's `RotaryEmbedding` (com.microsoft; positions from 0),
- the attention as ONNX's `Attention` (opset 23: grouped heads, causal; its CUDA prompt path calls
  flash attention without a KV write), which needs no mask for right-padded rows (a real token never
  attends to the padding after it),
- the `present` outputs as the rotated keys and the values transposed to the cache's layout, so that
  `OrtModelForCausalLM` loads and runs the package as it is.

The past inputs are left unread: the rewritten package is only right for a prefill from an empty
cache (a forward of whole rows, as `graph_options.py` and lm-eval's padded rows run it; on a CPU
with `prefill_chunk=0`), never for decode steps. `graph_options.py --option attention=onnx` times it
beside the builder's export, its logits against transformers fp32.

    python benchmarks/attention_rewrite.py PACKAGE_DIR OUT_DIR
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

OPSET = 23  # ONNX's Attention


def rewrite_package(package: Path, out: Path) -> int:
    """`package` with its GroupQueryAttention nodes rewritten (module docstring) into `out`; returns
    how many were."""
    package, out = Path(package), Path(out)
    config = json.loads((package / "genai_config.json").read_text())["model"]["decoder"]
    model = onnx.load(str(package / config["filename"]))
    count = rewrite_graph(model.graph, int(config["head_size"]))
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = max(opset.version, OPSET)
    out.mkdir(parents=True, exist_ok=True)
    for item in package.iterdir():
        if item.is_file() and not item.name.startswith(config["filename"]):
            shutil.copy2(item, out / item.name)
    onnx.save_model(model, str(out / config["filename"]), save_as_external_data=True,
                    all_tensors_to_one_file=True, location=config["filename"] + ".data", size_threshold=1024)
    return count


def rewrite_graph(graph: onnx.GraphProto, head_size: int) -> int:
    """Every GroupQueryAttention node of `graph` replaced in place; the nodes left unread removed."""
    graph.initializer.extend([
        numpy_helper.from_array(np.array([0], dtype=np.int64), "/rewrite/position_0"),
        numpy_helper.from_array(np.array([0, 0, -1, head_size], dtype=np.int64), "/rewrite/heads"),
        numpy_helper.from_array(np.array([0, 0, -1], dtype=np.int64), "/rewrite/hidden"),
    ])
    nodes, count = [], 0
    for node in graph.node:
        if node.op_type != "GroupQueryAttention":
            nodes.append(node)
            continue
        nodes += _attention_nodes(node, f"/rewrite/{count}", head_size)
        count += 1
    if not count:
        raise ValueError("the graph has no GroupQueryAttention node to rewrite")
    del graph.node[:]
    graph.node.extend(_reachable(nodes, [o.name for o in graph.output]))
    return count


def _attention_nodes(gqa: onnx.NodeProto, at: str, head_size: int) -> list[onnx.NodeProto]:
    attrs = {a.name: helper.get_attribute_value(a) for a in gqa.attribute}
    heads, kv_heads = attrs["num_heads"], attrs["kv_num_heads"]
    if attrs.get("local_window_size", -1) != -1 or attrs.get("softcap", 0.0):
        raise ValueError(f"{gqa.name}: sliding windows and softcap are not rewritten")
    inputs = list(gqa.input) + [""] * (16 - len(gqa.input))
    query, key, value, cos, sin, q_norm, k_norm = (inputs[i] for i in (0, 1, 2, 7, 8, 14, 15))
    nodes = []
    if not key:  # one packed input: split it
        sizes = numpy_helper.from_array(np.array([heads, kv_heads, kv_heads], dtype=np.int64) * head_size,
                                        f"{at}/sizes")
        query, key, value = f"{at}/query", f"{at}/key", f"{at}/value"
        nodes.append(helper.make_node("Constant", [], [sizes.name], value=sizes))
        nodes.append(helper.make_node("Split", [gqa.input[0], sizes.name], [query, key, value], axis=-1))
    for name, weight, count in (("query", q_norm, heads), ("key", k_norm, kv_heads)):
        source = query if name == "query" else key
        if weight:
            nodes += [helper.make_node("Reshape", [source, "/rewrite/heads"], [f"{at}/{name}_heads"]),
                      helper.make_node("SimplifiedLayerNormalization", [f"{at}/{name}_heads", weight],
                                       [f"{at}/{name}_normed"], axis=-1, epsilon=attrs.get("qk_norm_epsilon", 1e-6),
                                       stash_type=1),
                      helper.make_node("Reshape", [f"{at}/{name}_normed", "/rewrite/hidden"], [f"{at}/{name}_n"])]
            source = f"{at}/{name}_n"
        if attrs.get("do_rotary", 0):
            nodes.append(helper.make_node("RotaryEmbedding", [source, "/rewrite/position_0", cos, sin],
                                          [f"{at}/{name}_r"], domain="com.microsoft", num_heads=count,
                                          interleaved=attrs.get("rotary_interleaved", 0)))
            source = f"{at}/{name}_r"
        if name == "query":
            query = source
        else:
            key = source
    extra = {"scale": attrs["scale"]} if "scale" in attrs else {}
    nodes.append(helper.make_node("Attention", [query, key, value], [gqa.output[0]], q_num_heads=heads,
                                  kv_num_heads=kv_heads, is_causal=1, name=f"{at}/attention", **extra))
    for source, present in ((key, gqa.output[1]), (value, gqa.output[2])):
        if present:
            nodes += [helper.make_node("Reshape", [source, "/rewrite/heads"], [f"{present}/bsnh"]),
                      helper.make_node("Transpose", [f"{present}/bsnh"], [present], perm=[0, 2, 1, 3])]
    return nodes


def _reachable(nodes: list[onnx.NodeProto], outputs: list[str]) -> list[onnx.NodeProto]:
    """The nodes some graph output depends on, in their order."""
    producer = {out: i for i, node in enumerate(nodes) for out in node.output}
    needed, stack = set(), [producer[o] for o in outputs if o in producer]
    while stack:
        i = stack.pop()
        if i in needed:
            continue
        needed.add(i)
        stack += [producer[name] for name in nodes[i].input if name in producer]
    return [node for i, node in enumerate(nodes) if i in needed]


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.strip().splitlines()[-1].strip())
    print(f"{rewrite_package(Path(sys.argv[1]), Path(sys.argv[2]))} GroupQueryAttention nodes rewritten")
