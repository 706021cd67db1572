"""What `ortmodule info` says of a package, read from its files without a session: the model's shape,
what it was exported for, its weights as transformers would count them, its graphs and what they
take, its generation defaults. For a first look at a package someone hands you, and for bug reports
beside `ortmodule env`."""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import onnx

from .hub import resolve
from .package import Package, graph_files, model_files, read_package
from .parameters import count_parameters

# Where a decoder's op says how it was exported: its attention, and its weights' quantization.
_ATTENTION_OPS = ("GroupQueryAttention", "MultiHeadAttention", "Attention", "PagedAttention")
_QUANTIZED_OPS = ("MatMulNBits", "GatherBlockQuantized", "MatMulInteger", "DynamicQuantizeMatMul", "QMoE")


def describe(path: str | Path, subfolder: str | None = None, revision: str | None = None) -> dict:
    """The package at `path` (a folder or a Hub repository id) as name -> value (JSON-ready)."""
    package = read_package(resolve(path, subfolder, revision))
    decoder = package.decoder
    total, embeddings = count_parameters(package)
    windows = collections.Counter(kv.window for kv in decoder.layers if kv.window)
    linear = {state.layer for state in decoder.states if state.kind == "recurrent"}
    return {
        "package": str(package.root),
        "model type": package.model_type,
        "exported for": package.exported_for or "cpu",
        "KV cache and activations": onnx.helper.tensor_dtype_to_string(decoder.kv_type).removeprefix("TensorProto."),
        "weights": _weight_kinds(decoder.path),
        "parameters": total,
        "parameters without embeddings": total - embeddings,
        "bytes on disk": sum(f.stat().st_size for f in model_files(package)),
        "layers": package.num_hidden_layers,
        "hidden size": package.hidden_size,
        "attention heads": package.num_attention_heads,
        "KV heads": package.num_key_value_heads,
        "head size": package.head_size,
        "sliding windows": {f"{size} tokens": count for size, count in windows.items()} or None,
        "convolution layers": len({s.layer for s in decoder.states} - linear) or None,
        "linear-attention layers": len(linear) or None,
        "vocabulary": package.vocab_size,
        "context length": package.context_length,
        "graphs": [str(p.relative_to(package.root)) for p in graph_files(package)],
        "token input": "input ids" if decoder.input_ids else f"embeddings from {package.embedding.path.name}",
        "takes media": _media(package) or None,
        "special tokens": {"bos": package.bos_token_id, "eos": package.eos_token_id, "pad": package.pad_token_id},
        "generation defaults": package.search or None,
    }


def _weight_kinds(path: Path) -> str:
    """The decoder's attention op and how its weights are kept: plain, or the quantized ops and their bits."""
    graph = onnx.load(str(path), load_external_data=False).graph
    ops = {node.op_type for node in graph.node}
    bits = {next((a.i for a in node.attribute if a.name == "bits"), 4) for node in graph.node
            if node.op_type in ("MatMulNBits", "GatherBlockQuantized")}  # both default to 4 bits
    quantized = ", ".join(op for op in _QUANTIZED_OPS if op in ops)
    kept = "unquantized" if not quantized else f"quantized ({quantized}" + (
        f"; {'/'.join(map(str, sorted(bits)))}-bit)" if bits else ")")
    return f"{kept}; attention {next((op for op in _ATTENTION_OPS if op in ops), 'none found')}"


def _media(package: Package) -> list[str]:
    """The genai_config sections of models beside the decoder that take media (vision, speech, ...)."""
    model = package.genai_config.get("model", {})
    return [key for key, value in model.items() if isinstance(value, dict) and key not in ("decoder", "embedding")
            and "filename" in value]


def print_description(path: str | Path, subfolder: str | None = None, revision: str | None = None,
                      as_json: bool = False, out=None) -> None:
    """`ortmodule info`: `describe` as `- name: value` lines (numbers with thousands separators), or JSON."""
    out = out or sys.stdout
    described = describe(path, subfolder, revision)
    if as_json:
        print(json.dumps(described, indent=2), file=out)
        return
    for name, value in described.items():
        if value is None:
            continue
        shown = f"{value:,}" if isinstance(value, int) else (
            json.dumps(value) if isinstance(value, (dict, list)) else value)
        print(f"- {name}: {shown}", file=out)
