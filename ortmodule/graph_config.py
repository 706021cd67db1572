"""The config fields a package's decoder graph states, for a package without its checkpoint's config.json
(the model builder writes none; `ortmodule export` keeps it): genai_config.json gives the shape, and the
graph the rest that code reads from `model.config` to compute numbers of its own. trl's fused LM head and
its distillation divide the backbone's projected hidden states by Granite's `logits_scaling` and cap them
with Gemma 2's `final_logit_softcapping`; its FLOP count multiplies by `intermediate_size`. Without these
fields the config class's defaults stood there (Granite's `logits_scaling` 1.0 for the checkpoint's 8),
and those numbers came out silently wrong.

Read from the graph: the ops between the LM head and the logits (`logits_scaling`,
`final_logit_softcapping`), the attention op's attributes (Granite's `attention_multiplier`, Gemma's
`query_pre_attn_scalar` and `attn_logit_softcapping`), the norms' epsilon, the first MLP's width, whether the
embedding table is the LM head's weight (`tie_word_embeddings`), the factors after the embedding table and on
the residual (Granite's `embedding_multiplier` and `residual_multiplier`); from the package's layers the
sliding window and each layer's kind (`layer_types`); transformers' model type and causal LM class from
genai_config's `model.type`; a mixture of experts' sizes from its `MoE` op. Each field is set only where
the config class has it. Not read: the rotary embedding's parameters (a scaled rotary's base cannot be told
from its tables) and the activation: those keep the class's defaults."""

from __future__ import annotations

import struct

import onnx_ir as ir
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from .constants import constant_tensor, readable
from .embeddings import token_table
from .graph import RewriteSkipped, find_lm_head
from .package import Package

_ATTENTION = ("GroupQueryAttention", "MultiHeadAttention", "Attention")
_NORMS = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "LayerNormalization",
          "SkipLayerNormalization")
_EPSILON_FIELDS = ("rms_norm_eps", "layer_norm_eps", "norm_eps", "layer_norm_epsilon")


def transformers_type(genai_type: str) -> tuple[str, str | None]:
    """transformers' model type and causal LM class for genai_config's `model.type`, which the model builder
    writes as the architecture's class name before "For", lower-cased (GptOssForCausalLM: "gptoss")."""
    if genai_type in CONFIG_MAPPING_NAMES:
        return genai_type, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(genai_type)
    for model_type, name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        if name.split("For")[0].lower() == genai_type:
            return model_type, name
    return genai_type, None


def graph_fields(package: Package, has) -> dict:
    """The fields the package states, of those the config class has (`has(name)`)."""
    graph = ir.load(package.decoder.path).graph  # the weights stay on disk: only the few read are loaded
    try:
        head = find_lm_head(graph, package.decoder.logits)  # (the head, the ops after it)
    except RewriteSkipped:
        head = None
    fields = {**_logits_fields(head), **_attention_fields(graph), **_layer_fields(package)}
    norm = next((n for n in graph if n.op_type in _NORMS and "epsilon" in n.attributes), None)
    if norm is not None:
        fields.update(dict.fromkeys(_EPSILON_FIELDS, _shortest(norm.attributes["epsilon"].as_float())))
    width = _mlp_width(graph)
    if width is not None:  # LFM2's field is a width its module adjusts (by 2/3, rounded) unless told not to
        fields.update(intermediate_size=width, block_auto_adjust_ff_dim=False)
    if package.decoder.input_ids is not None:  # else the embedding table is in the embedding model's graph
        fields.update(_embedding_fields(graph, package.decoder.input_ids, head))
    fields.update(_expert_fields(graph, package.hidden_size))
    residual = next((n for n in graph if n.op_type == "Mul" and "/residual_mul/" in n.name), None)
    if residual is not None and (factor := _scalar(residual)) is not None:
        fields["residual_multiplier"] = factor
    width = fields.pop("expert_width", None)  # the experts' width: its own field, or the MLP's where that is it
    if width is not None:
        fields["moe_intermediate_size" if has("moe_intermediate_size") else "intermediate_size"] = width
    return {name: value for name, value in fields.items() if has(name)}


def _shortest(value: float) -> float:
    """A float32 attribute as the shortest decimal that rounds to it (1e-05, not 9.999999747378752e-06)."""
    for digits in range(1, 10):
        short = float(f"{value:.{digits}g}")
        if struct.unpack("f", struct.pack("f", short))[0] == struct.unpack("f", struct.pack("f", value))[0]:
            return short
    return value


def _scalar(node: ir.Node) -> float | None:
    """The one-element constant among a node's inputs, as a float; None where there is none."""
    for value in node.inputs:
        tensor = constant_tensor(value)
        if tensor is not None and tensor.size == 1:
            return _shortest(float(readable(tensor).numpy().reshape(-1)[0]))
    return None


def _logits_fields(head: tuple[ir.Node, list[ir.Node]] | None) -> dict:
    """Granite's scaling (the logits divided by `logits_scaling`) and Gemma 2's soft-capping
    (cap * tanh(logits / cap)), from the ops between the LM head and the logits (`find_lm_head`'s)."""
    if head is None:
        return {}
    _, chain = head
    steps = [(n.op_type, _scalar(n)) for n in reversed(chain) if n.op_type not in ("Cast", "Identity")]
    fields = {"logits_scaling": 1.0, "final_logit_softcapping": None}
    if len(steps) == 1 and steps[0][0] in ("Mul", "Div") and steps[0][1]:
        (op, factor), = steps
        fields["logits_scaling"] = factor if op == "Div" else _shortest(1 / factor)
    elif [op for op, _ in steps] == ["Div", "Tanh", "Mul"] and steps[0][1] == steps[2][1]:
        fields["final_logit_softcapping"] = steps[0][1]
    elif steps:
        return {}  # something else: the class's defaults stay
    return fields


def _attention_fields(graph: ir.Graph) -> dict:
    """The attention op's scale and soft-cap: Granite's `attention_multiplier` (the scale itself) and
    Gemma's `query_pre_attn_scalar` (the scale is its inverse square root), `attn_logit_softcapping`."""
    node = next((n for n in graph if n.op_type in _ATTENTION and n.domain == "com.microsoft"), None)
    if node is None:
        return {}
    fields = {}
    if "softcap" in node.attributes:
        fields["attn_logit_softcapping"] = _shortest(node.attributes["softcap"].as_float()) or None
    scale = node.attributes["scale"].as_float() if "scale" in node.attributes else 0.0
    if scale > 0:
        fields["attention_multiplier"] = _shortest(scale)
        if abs((scalar := 1 / scale**2) - round(scalar)) < 1e-3 * scalar:
            fields["query_pre_attn_scalar"] = round(scalar)
    return fields


def _mlp_width(graph: ir.Graph) -> int | None:
    """The first layer's MLP width: the input features of its down projection."""
    for node in graph:
        if node.name.startswith("/model/layers.0/mlp/down_proj/"):
            if node.op_type == "MatMulNBits" and "K" in node.attributes:
                return node.attributes["K"].as_int()
            weight = constant_tensor(node.inputs[1]) if node.op_type == "MatMul" else None
            if weight is not None and len(weight.shape) == 2:
                return int(weight.shape[0])
    return None


def _expert_fields(graph: ir.Graph, hidden_size: int) -> dict:
    """A mixture of experts' sizes from the first layer's `MoE` op: the experts chosen per token, their count
    and width (its down projections' weights `[experts, hidden, width]`), and the dense layers before it."""
    node = next((n for n in graph if n.op_type in ("MoE", "QMoE") and n.domain == "com.microsoft"), None)
    if node is None or len(node.inputs) < 5 or node.inputs[4] is None or node.inputs[4].shape is None:
        return {}
    experts, *dims = node.inputs[4].shape.numpy() if node.inputs[4].shape.is_static() else (None,)
    fields = {"num_experts_per_tok": node.attributes["k"].as_int()} if "k" in node.attributes else {}
    if isinstance(experts, int):
        fields.update(num_local_experts=experts, num_experts=experts)
    widths = [d for d in dims if d != hidden_size] if node.op_type == "MoE" else []  # QMoE's are packed
    if len(dims) == 2 and len(widths) <= 1:
        fields["expert_width"] = widths[0] if widths else hidden_size
    layer = node.name.split("/")[2] if node.name.startswith("/model/layers.") else ""
    if layer.removeprefix("layers.").isdigit():
        fields["num_dense_layers"] = int(layer.removeprefix("layers."))
    return fields


def _embedding_fields(graph: ir.Graph, input_ids: str, found: tuple[ir.Node, list[ir.Node]] | None) -> dict:
    """Whether the embedding table is the LM head's weight (itself, or its transpose: the builder's tied
    export), and the factor after it (Granite's `embedding_multiplier`; Gemma's is its module's own)."""
    if found is None:
        return {}
    try:
        gather, factor = token_table(graph, input_ids)
    except ValueError:
        return {}
    head, _ = found
    table = gather.inputs[0]
    producer = table.producer()
    if producer is not None and producer.op_type == "Transpose":
        table = producer.inputs[0]
    fields = {"embedding_multiplier": factor or 1.0}
    tied = True if table is head.inputs[1] else _same_rows(gather.inputs[0], head) if head.op_type == "MatMul" else None
    if tied is not None:  # (a 4-bit head beside a float table does not tell: the class's default stays)
        fields["tie_word_embeddings"] = tied
    return fields


def _same_rows(table: ir.Value, head: ir.Node) -> bool | None:
    """Whether a float embedding table `[vocab, hidden]` holds the LM head's weight `[hidden, vocab]`
    transposed, by a few rows across the vocabulary (read from the weight file's pages alone): the builder
    writes a tied checkpoint's two apart unless told to share them (`shared_embeddings`)."""
    rows, weight = constant_tensor(table), constant_tensor(head.inputs[1])
    if rows is None or weight is None or rows.dtype != weight.dtype or len(rows.shape) != 2 or \
            tuple(rows.shape) != tuple(reversed(weight.shape)):
        return None
    rows, weight, vocab = readable(rows).numpy(), readable(weight).numpy(), rows.shape[0]
    return all(bool((rows[i] == weight[:, i]).all()) for i in sorted({0, 1, vocab // 3, vocab // 2, vocab - 1}))


def _layer_fields(package: Package) -> dict:
    """The sliding window and each layer's kind (attention over a window or the whole past, or LFM2's
    convolution), where the package's layers account for every layer."""
    windows = [layer.window for layer in package.decoder.layers]
    convolutions = {state.layer for state in package.decoder.states}
    if len(windows) + len(convolutions) != package.num_hidden_layers:
        return {}  # layers that share another's KV (Gemma 4's last ones): not told here
    sizes = {window for window in windows if window}
    kinds = iter("sliding_attention" if window else "full_attention" for window in windows)
    layer_types = ["conv" if i in convolutions else next(kinds) for i in range(package.num_hidden_layers)]
    return {"layer_types": layer_types, "sliding_window": sizes.pop() if len(sizes) == 1 else None,
            "full_attn_idxs": None}  # LFM2's older form of `layer_types`, which its config reads when that is None
