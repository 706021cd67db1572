"""`get_input_embeddings()`: the package's token-embedding table as a frozen `torch.nn.Embedding`.

The table is the initializer that the graph's `Gather` over the token ids reads (the decoder's, or
a multimodal package's embedding model's), or its transpose where the embeddings share the LM
head's weight. transformers 5's Gemma models (Gemma to Gemma 4) scale the embeddings inside their
embedding module (`GemmaTextScaledWordEmbedding`: times sqrt(hidden)); their graphs multiply the
gathered rows by that constant, which the module returned here applies too. Other families that
scale (Granite's `embedding_multiplier`) do it in the model's forward, after the module, as their
graphs' `Mul` after the table does. A block-quantized table (`GatherBlockQuantized`, the builder's
int4 packages with tied embeddings) and a 4-bit LM head (`MatMulNBits`) are given dequantized, by ONNX
Runtime's own kernels run once over the whole table (`_dequantized`); a graph that gathers otherwise is
a `NotSupportedError` naming what was found.

`take_embeddings` rewrites a decoder graph to take such embeddings instead of the token ids, for
`forward(inputs_embeds=...)` (variants.py).
"""

from __future__ import annotations

import onnx
import onnx_ir as ir
import onnxruntime as ort
import torch

from . import runtime
from .constants import constant_tensor, readable
from .graph import RewriteSkipped, find_lm_head
from .package import Package

EMBEDS = "ortmodule_inputs_embeds"  # the input of a graph that takes embeddings (take_embeddings)

# transformers' model types whose embedding module multiplies by the embedding scale itself.
_SCALED_INSIDE = ("gemma",)
_TORCH = {ir.DataType.FLOAT: torch.float32, ir.DataType.FLOAT16: torch.float16, ir.DataType.BFLOAT16: torch.bfloat16}


class ScaledEmbedding(torch.nn.Embedding):
    """An embedding whose rows are multiplied by `scale` (transformers' scaled word embeddings)."""

    def __init__(self, weight: torch.Tensor, scale: float):
        super().__init__(*weight.shape, _weight=weight, _freeze=True)
        self.scale = scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * torch.tensor(self.scale, dtype=self.weight.dtype)


def _torch(tensor: ir.TensorProtocol) -> torch.Tensor:
    """A float initializer's values as a torch tensor of its shape (a copy, on the host)."""
    return torch.frombuffer(bytearray(readable(tensor).tobytes()), dtype=_TORCH[tensor.dtype]).view(tuple(tensor.shape))


def _dequantized(node: ir.Node, weights: dict[int, str], given: tuple[int, str, torch.Tensor],
                 output: torch.Tensor) -> torch.Tensor:
    """`node` (a block-quantized op) run once by ONNX Runtime on the CPU into `output`: its inputs at the
    indices of `weights` (index -> name) read from the package (through a Reshape of a weight, as the
    builder's tied int4 table reads the head's), `given` (index, name, tensor) bound as the graph's one
    input, the rest left out; `accuracy_level` 0 (the float path: the weights as they dequantize)."""
    constants, names = [], [""] * (max([*weights, given[0]]) + 1)
    for index, name in weights.items():
        value = node.inputs[index]
        producer = value.producer()
        tensor = constant_tensor(producer.inputs[0] if producer is not None and producer.op_type == "Reshape"
                                 else value)
        if tensor is None or value.shape is None or not value.shape.is_static():
            raise ValueError(f"'{node.name}' reads '{value.name}', which is not a weight of a known shape")
        constants.append(onnx.helper.make_tensor(name, int(tensor.dtype), list(value.shape), readable(tensor).tobytes(),
                                                 raw=True))
        names[index] = name
    names[given[0]] = given[1]
    attributes = {name: attr.value for name, attr in node.attributes.items()}
    if "accuracy_level" in attributes:
        attributes["accuracy_level"] = 0
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node(node.op_type, names, ["out"], domain=node.domain, **attributes)], "dequantize",
        [onnx.helper.make_tensor_value_info(given[1], runtime.ONNX_TYPE[given[2].dtype], list(given[2].shape))],
        [onnx.helper.make_tensor_value_info("out", runtime.ONNX_TYPE[output.dtype], list(output.shape))], constants)
    model = onnx.helper.make_model(graph, ir_version=10, opset_imports=[onnx.helper.make_opsetid("", 21),
                                                                        onnx.helper.make_opsetid(node.domain, 1)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    binding = session.io_binding()
    runtime.bind_input(binding, given[1], given[2])
    runtime.bind_output(binding, "out", output)
    session.run_with_iobinding(binding)
    return output


def _quantized_table(gather: ir.Node, hidden: int) -> torch.Tensor:
    """A `GatherBlockQuantized` token table `[vocab, hidden]` in floats: the op over every row."""
    rows = gather.inputs[0].shape[0] if gather.inputs[0].shape is not None else None
    scales = constant_tensor(gather.inputs[2]) if len(gather.inputs) > 2 else None
    if not isinstance(rows, int) or scales is None or scales.dtype not in _TORCH:
        raise ValueError(f"'{gather.name}' gathers from block-quantized weights this reading does not know")
    weights = {0: "data", 2: "scales"} | ({3: "zero_points"} if len(gather.inputs) > 3 and gather.inputs[3] else {})
    out = torch.empty(rows, hidden, dtype=_TORCH[scales.dtype])
    return _dequantized(gather, weights, (1, "indices", torch.arange(rows)), out)


def _quantized_head(head: ir.Node) -> torch.Tensor:
    """A `MatMulNBits` LM head's weight `[hidden, vocab]` in floats: the op over the identity."""
    scales = constant_tensor(head.inputs[2]) if len(head.inputs) > 2 else None
    if scales is None or scales.dtype not in _TORCH:
        raise ValueError(f"the LM head '{head.name}' is a MatMulNBits whose scales this reading does not know")
    hidden, vocab = head.attributes["K"].as_int(), head.attributes["N"].as_int()
    # its zero points and act-order indices where it has them; its bias (input 5) is the Linear's
    weights = {1: "weight", 2: "scales"} | {i: n for i, n in ((3, "zero_points"), (4, "g_idx"))
                                              if len(head.inputs) > i and head.inputs[i] is not None}
    eye = torch.eye(hidden, dtype=_TORCH[scales.dtype])
    return _dequantized(head, weights, (0, "identity", eye), torch.empty(hidden, vocab, dtype=eye.dtype))


def _table(gather: ir.Node, hidden: int) -> torch.Tensor:
    """The `[vocab, hidden]` table a token `Gather` reads: an initializer, or one transposed."""
    if gather.op_type == "GatherBlockQuantized":
        return _quantized_table(gather, hidden)
    source, transposed = gather.inputs[0], False
    producer = source.producer()
    if producer is not None and producer.op_type == "Transpose" and constant_tensor(producer.inputs[0]) is not None:
        source, transposed = producer.inputs[0], True
    tensor = constant_tensor(source)
    if tensor is None or tensor.dtype not in _TORCH or len(tensor.shape) != 2:
        raise ValueError(f"'{gather.name}' gathers from '{source.name}', not a float table of the weights")
    data = _torch(tensor)
    return data.t().contiguous() if transposed else data


def _token_gather(graph: ir.Graph, input_ids: str, where: str) -> ir.Node:
    """The one `Gather` that reads the token ids from a float table."""
    readers = [node for node in graph if any(v is not None and v.name == input_ids for v in node.inputs)]
    gathers = [node for node in readers if node.op_type in ("Gather", "GatherBlockQuantized")]
    if len(gathers) != 1:
        raise ValueError(f"{where} reads the token ids in {[n.op_type for n in readers]}, not in one Gather")
    return gathers[0]


def _factor(gather: ir.Node) -> tuple[ir.Node | None, float | None]:
    """The `Mul` by a constant right after the table (Gemma's square root of the width, Granite's
    `embedding_multiplier`), and its factor; (None, None) where there is none."""
    users = list(gather.outputs[0].uses())
    mul = users[0].node if len(users) == 1 and users[0].node.op_type == "Mul" else None
    if mul is None:
        return None, None
    other = constant_tensor(mul.inputs[1] if mul.inputs[0] is gather.outputs[0] else mul.inputs[0])
    if other is None or other.size != 1 or other.dtype not in _TORCH:
        return None, None
    return mul, float(_torch(other).item())


def _scaling(gather: ir.Node, model_type: str) -> tuple[ir.Node | None, float | None]:
    """The `Mul` by a constant after the table that transformers' module applies itself (Gemma's), and its factor."""
    return _factor(gather) if model_type.startswith(_SCALED_INSIDE) else (None, None)


def token_table(graph: ir.Graph, input_ids: str) -> tuple[ir.Node, float | None]:
    """The one `Gather` that reads the token ids from the table, and the constant its rows are multiplied by
    right after it (None where they are not). Raises ValueError where the graph reads the ids otherwise."""
    gather = _token_gather(graph, input_ids, "the decoder graph")
    return gather, _factor(gather)[1]


def take_embeddings(g: ir.Graph, input_ids: str, model_type: str, hidden_size: int) -> None:
    """Make the graph take `EMBEDS` `[batch, sequence, hidden]` (what `input_embeddings` gives for
    the ids) in place of the token ids: the table's `Gather` (and Gemma's scaling) removed, the ids'
    other readers (their `Shape`) reading the embeddings' first two dimensions. Raises
    `RewriteSkipped` where the graph reads the ids otherwise."""
    try:
        gather = _token_gather(g, input_ids, "the decoder graph")
    except ValueError as reason:
        raise RewriteSkipped(str(reason)) from None
    mul, _ = _scaling(gather, model_type)
    cut = (mul or gather).outputs[0]
    dtype = cut.dtype or gather.inputs[0].dtype
    embeds = ir.Value(name=EMBEDS, type=ir.TensorType(dtype), shape=ir.Shape(["batch_size", "sequence_length",
                                                                               hidden_size]))
    g.inputs.append(embeds)
    cut.replace_all_uses_with(embeds)
    table = gather.inputs[0].producer()
    for node in (mul, gather, table if table is not None and table.op_type == "Transpose" else None):
        if node is not None and not any(list(v.uses()) for v in node.outputs):
            g.remove(node, safe=True)
    ids = next(v for v in g.inputs if v.name == input_ids)
    for use in list(ids.uses()):
        node = use.node
        if node.op_type != "Shape":
            raise RewriteSkipped(f"'{node.name}' ({node.op_type}) reads the token ids besides the embeddings' table")
        end = node.attributes["end"].as_int() if "end" in node.attributes else 2
        node.attributes["end"] = ir.AttrInt64("end", end + 2 if end < 0 else min(end, 2))
        node.replace_input_with(use.idx, embeds)
    g.inputs.remove(ids)


def input_embeddings(package: Package, model_type: str, device: torch.device) -> torch.nn.Embedding:
    """The package's token embeddings as transformers' `get_input_embeddings()` gives them (frozen,
    on `device`, in the package's precision). Raises ValueError naming what the graph has instead."""
    if package.embedding is not None:
        path, input_ids = package.embedding.path, package.embedding.input_ids
    else:
        path, input_ids = package.decoder.path, package.decoder.input_ids
    gather = _token_gather(ir.load(path).graph, input_ids, path.name)
    weight = _table(gather, package.hidden_size).to(device)
    _, scale = _scaling(gather, model_type)
    if scale is None:
        return torch.nn.Embedding.from_pretrained(weight, freeze=True)
    return ScaledEmbedding(weight, scale)


def output_embeddings(package: Package, device: torch.device) -> torch.nn.Linear:
    """The package's LM head as transformers' `get_output_embeddings()` gives it: a frozen
    `torch.nn.Linear(hidden, vocab)` (with the head's bias where the graph adds one right after it;
    soft-capping and logit scaling stay outside, as in transformers' models); a 4-bit or 8-bit head's
    weight as it dequantizes. Raises ValueError where the head is neither a MatMul by a float weight nor
    a MatMulNBits."""
    try:
        head, chain = find_lm_head(ir.load(package.decoder.path).graph, package.decoder.logits)
    except RewriteSkipped as reason:
        raise ValueError(str(reason)) from None
    weight = constant_tensor(head.inputs[1])
    if head.op_type == "MatMulNBits":
        table = _quantized_head(head)
    elif head.op_type != "MatMul" or weight is None or weight.dtype not in _TORCH or len(weight.shape) != 2:
        raise ValueError(f"the LM head '{head.name}' is a {head.op_type}, not a MatMul by a float weight")
    else:
        table = _torch(weight)
    bias = None
    if head.op_type == "MatMulNBits" and len(head.inputs) > 5 and head.inputs[5] is not None:
        bias = _torch(constant_tensor(head.inputs[5]))
    if chain and chain[-1].op_type == "Add":  # the node right after the head (the chain runs from the output back)
        added = next((t for t in map(constant_tensor, chain[-1].inputs) if t is not None), None)
        if added is not None and tuple(added.shape) == (table.shape[1],):
            bias = _torch(added)
    linear = torch.nn.Linear(*table.shape, bias=False, device="meta")  # no random init of a vocab-wide weight
    linear.weight = torch.nn.Parameter(table.t().contiguous().to(device), requires_grad=False)
    if bias is not None:
        linear.bias = torch.nn.Parameter(bias.to(device), requires_grad=False)
    return linear
