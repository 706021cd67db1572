"""A package's weights counted as transformers counts a model's parameters (`num_parameters()`), read
from its graphs' structure (no weights loaded but a few sampled elements).

An ONNX graph keeps more than a PyTorch model's parameters among its initializers and some of them in
other forms, so the count reads what each initializer is:

- rotary cos and sin tables (what GroupQueryAttention and RotaryEmbedding read, mobius-onnx's
  `cos_cache`/`sin_cache`) are left out: transformers computes them from buffers, not parameters;
- integer tensors are constants (axes, shapes), left out, except quantized weights: MatMulNBits'
  packed weight counts its K x N elements and GatherBlockQuantized's its elements unpacked, their
  scales and zero points left out (as transformers counts a 4-bit model's weights at their elements);
- an embedding (the table a Gather or GatherBlockQuantized looks rows up in, through a Transpose or
  Reshape of a weight shared with the LM head) is what `exclude_embeddings` leaves out, as
  transformers leaves out its `nn.Embedding` weights;
- a weight shared by two graphs of a multimodal package (a tied LM head in the decoder and the token
  embedding in the embedding model) counts once, as a tied parameter does in transformers: two
  tensors of the same elements (or one the other's transpose) whose sampled elements are equal.

For the model builder's text packages this is transformers' count on the same weights exactly
(tests/test_modeling.py); a multimodal package's graphs can keep a few constants as initializers, and
leave out what transformers loads but never runs (SigLIP's pooling head in Gemma 3), so there the
count is that of the weights the package runs.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import onnx

from .package import Package, graph_files

logger = logging.getLogger("ortmodule")

_FLOAT_BITS = {onnx.TensorProto.FLOAT: 32, onnx.TensorProto.FLOAT16: 16, onnx.TensorProto.BFLOAT16: 16,
               onnx.TensorProto.DOUBLE: 64}
# Inputs that hold rotary cos and sin tables; and quantized ops: (packed weight, its scales and zero points).
_ROTARY_TABLES = {("GroupQueryAttention", "com.microsoft"): (7, 8), ("RotaryEmbedding", "com.microsoft"): (2, 3),
                  ("RotaryEmbedding", ""): (1, 2)}
_QUANTIZED = {"MatMulNBits": (1, (2, 3)), "GatherBlockQuantized": (0, (2, 3))}
_VIEWS = {"Transpose", "Reshape", "Cast", "Identity", "Squeeze", "Unsqueeze"}  # a weight seen another way
_SAMPLES = 16  # elements compared to tell a weight shared by two graphs


def count_parameters(package: Package) -> tuple[int, int]:
    """(all the weights of the package's graphs, of them the embeddings'), as transformers'
    `num_parameters()` and the part `exclude_embeddings=True` leaves out."""
    weights: list[_Weight] = []
    for path in graph_files(package):
        try:
            graph = onnx.load(str(path), load_external_data=False).graph
        except Exception as e:  # noqa: BLE001  protobuf's DecodeError and others: a count is not worth a crash
            logger.warning("counting the parameters: %s is not a readable ONNX graph (%s); its weights are not counted",
                           path, type(e).__name__)
            continue
        for weight in _graph_weights(path, graph):
            twin = next((w for w in weights if w.path != path and weight.same_as(w)), None)
            if twin is None:
                weights.append(weight)
            else:  # a tied LM head and embedding: counted once, as the embedding
                twin.embedding = True
    return sum(w.count for w in weights), sum(w.count for w in weights if w.embedding)


class _Weight:
    """One initializer that counts: its elements as transformers counts them, whether it is an
    embedding, and where its data is (to compare it with another graph's)."""

    def __init__(self, path: Path, tensor: onnx.TensorProto, count: int, embedding: bool):
        self.path, self.tensor, self.count, self.embedding = path, tensor, count, embedding

    def same_as(self, other: _Weight) -> bool:
        """Whether this is `other` kept again (an embedding table shared by two graphs: a tied LM head): of
        the same element type and elements, laid out alike or (2-D) transposed, and equal at `_SAMPLES`
        spread positions."""
        mine, theirs = list(self.tensor.dims), list(other.tensor.dims)
        if not (self.embedding or other.embedding) or len(mine) < 2 or self.tensor.data_type != other.tensor.data_type:
            return False  # only an embedding table is shared between graphs (norm weights of ones are alike, not tied)
        if math.prod(mine) != math.prod(theirs):
            return False
        size = math.prod(mine)
        spots = [(k * 7919 + 13) % size for k in range(_SAMPLES)]
        if mine == theirs:
            pairs = [(i, i) for i in spots]
        elif len(mine) == 2 and theirs == mine[::-1]:  # [rows, columns] against [columns, rows]
            pairs = [(i, (i % mine[1]) * mine[0] + i // mine[1]) for i in spots]
        else:
            return False
        a, b = _elements(self, [i for i, _ in pairs]), _elements(other, [j for _, j in pairs])
        return a is not None and a == b


def _graph_weights(path: Path, graph: onnx.GraphProto) -> list[_Weight]:
    """The initializers of `graph` that are weights, each counted (module docstring)."""
    tensors = {t.name: t for t in graph.initializer}
    made = {output: node for node in graph.node for output in node.output}

    def source(name: str) -> str | None:  # the initializer behind a view of it
        for _ in range(8):
            if name in tensors or name not in made or made[name].op_type not in _VIEWS:
                break
            name = made[name].input[0]
        return name if name in tensors else None

    skipped, counts, embeddings = set(), {}, set()
    for node in graph.node:
        inputs = [source(name) if name else None for name in node.input]
        skipped.update(inputs[i] for i in _ROTARY_TABLES.get((node.op_type, node.domain), ()) if i < len(inputs))
        if node.op_type == "Gather" and node.input and re.search(r"(cos|sin)_cache", node.input[0]):
            skipped.add(inputs[0])
        packed, extra = _QUANTIZED.get(node.op_type, (None, ()))
        skipped.update(inputs[i] for i in extra if i < len(inputs))
        if packed is not None and inputs[packed]:
            counts[inputs[packed]] = _unpacked(node, tensors[inputs[packed]])
        if node.op_type in ("Gather", "GatherBlockQuantized") and inputs and inputs[0]:
            table = tensors[inputs[0]]
            if len(table.dims) >= 2 and (table.data_type in _FLOAT_BITS or inputs[0] in counts):
                embeddings.add(inputs[0])
    return [_Weight(path, t, counts.get(name, math.prod(t.dims)), name in embeddings)
            for name, t in tensors.items()
            if name not in skipped and (t.data_type in _FLOAT_BITS or name in counts)]


def _unpacked(node: onnx.NodeProto, tensor: onnx.TensorProto) -> int:
    """A quantized weight's elements: MatMulNBits' K x N; GatherBlockQuantized's data unpacked from bytes."""
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "MatMulNBits":
        return int(attributes["K"]) * int(attributes["N"])
    per_byte = 8 // int(attributes.get("bits", 4)) if tensor.data_type == onnx.TensorProto.UINT8 else 1
    return math.prod(tensor.dims) * per_byte


def _elements(weight: _Weight, indices: list[int]) -> list[bytes] | None:
    """The bytes of a weight's elements at flat `indices`, read from its raw data or its external file;
    None where it keeps them otherwise (typed fields, a file that cannot be read)."""
    tensor = weight.tensor
    width = _FLOAT_BITS.get(tensor.data_type, 8) // 8  # packed quantized weights: compared byte by byte
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        entries = {e.key: e.value for e in tensor.external_data}
        try:
            with open(weight.path.parent / entries["location"], "rb") as data:
                found = []
                for i in indices:
                    data.seek(int(entries.get("offset", 0)) + i * width)
                    found.append(data.read(width))
                return found
        except (OSError, KeyError):
            return None
    if tensor.raw_data:
        return [tensor.raw_data[i * width:(i + 1) * width] for i in indices]
    return None
