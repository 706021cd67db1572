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
genai_config's `model.type`; a mixture of experts' sizes from its `MoE` op; the rotary embedding's base and
the share of each head it turns (`rope_parameters`), from its cos and sin tables, where they are the plain
rotary's (each pair of columns turns by `base ** (-2i / dim)` a position: a scaled rotary's tables, Llama
3's, YaRN's, linear, are another curve, whose parameters they do not tell apart: those keep the class's
defaults); the MLP's activation (`hidden_act`, Gemma's `hidden_activation`) from the first layer's ops. Each
field is set only where the config class has it."""

from __future__ import annotations

import copy
import logging
import math
import struct

import onnx_ir as ir
import torch
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from .constants import constant_tensor, readable
from .embeddings import token_table
from .graph import RewriteSkipped, find_lm_head
from .package import Package

logger = logging.getLogger("ortmodule")
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


def graph_fields(package: Package, config) -> dict:
    """The fields the package states, of those `config` (the config class's defaults) has."""
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
        fields["moe_intermediate_size" if hasattr(config, "moe_intermediate_size") else "intermediate_size"] = width
    fields.update(_activation_fields(graph, config))
    rotaries = _rotaries(graph, package.head_size)
    rope = _rope_parameters(getattr(config, "rope_parameters", None), rotaries, fields.get("layer_types"))
    if rope is not None:
        fields["rope_parameters"] = rope
    if None in rotaries.values():
        logger.info("ortmodule: %s: its rotary tables are not a plain rotary's (a scaled one: Llama 3's, YaRN's, "
                    "linear); model.config.rope_parameters keeps the config class's defaults there", package.root)
    return {name: value for name, value in fields.items() if hasattr(config, name)}


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
    """The sliding window and each layer's kind (attention over a window or the whole past, LFM2's
    convolution, Qwen3.5's linear attention), where the package's layers account for every layer."""
    windows = [layer.window for layer in package.decoder.layers]
    convolutions = {state.layer for state in package.decoder.states}
    linear = {state.layer for state in package.decoder.states if state.kind == "recurrent"}
    if len(windows) + len(convolutions) != package.num_hidden_layers:
        return {}  # layers that share another's KV (Gemma 4's last ones): not told here
    sizes = {window for window in windows if window}
    kinds = iter("sliding_attention" if window else "full_attention" for window in windows)
    layer_types = ["linear_attention" if i in linear else "conv" if i in convolutions else next(kinds)
                   for i in range(package.num_hidden_layers)]
    return {"layer_types": layer_types, "sliding_window": sizes.pop() if len(sizes) == 1 else None,
            "full_attn_idxs": None}  # LFM2's older form of `layer_types`, which its config reads when that is None


def _rotaries(graph: ir.Graph, head_size: int) -> dict[int, tuple[float, float] | None]:
    """Each layer's rotary (its base, the share of the head it turns), from the cos and sin tables its
    attention op or rotary op reads; None for a layer whose tables are not a plain rotary's."""
    bases, layers = {}, {}
    for node in graph:
        at = (7, 8) if node.op_type == "GroupQueryAttention" else (2, 3) if node.op_type == "RotaryEmbedding" else None
        layer = node.name.split("/")[2].removeprefix("layers.") if node.name.startswith("/model/layers.") else ""
        if node.domain != "com.microsoft" or at is None or len(node.inputs) <= at[1] or not layer.isdigit():
            continue
        cos, sin = (constant_tensor(node.inputs[i]) for i in at)
        if cos is None or sin is None:
            continue
        key = (node.inputs[at[0]].name, node.inputs[at[1]].name)
        if key not in bases:
            exact = cos.dtype in (ir.DataType.FLOAT, ir.DataType.DOUBLE)
            tolerance = 1e-5 if exact else 1e-2
            base = _plain_rotary(*(_table(t) for t in (cos, sin)), tolerance)
            bases[key] = None if base is None else _rounded(base, tolerance / 10)
        base = bases[key]
        layers[int(layer)] = None if base is None else (base, 2 * cos.shape[-1] / head_size)
    return layers


def _table(tensor: ir.TensorProtocol, positions: int = 512) -> torch.Tensor:
    """A rotary table's first positions, in float64."""
    return torch.from_numpy(readable(tensor).numpy()[:positions].astype("float64"))


def _plain_rotary(cos: torch.Tensor, sin: torch.Tensor, tolerance: float) -> float | None:
    """The base of a plain rotary's tables `[positions, dim / 2]` (column i turns by `base ** (-2i / dim)` a
    position, at unit length), else None; `tolerance`: the tables' rounding (relative). Each column's turn a
    position is fitted over the first positions (their angles unwrapped), so that half-precision tables
    tell it too."""
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] < 2 or cos.shape[1] < 2:
        return None
    if (cos**2 + sin**2 - 1).abs().max() > 10 * tolerance:  # scaled by an attention factor (YaRN's)
        return None
    steps = torch.atan2(sin, cos).diff(dim=0)  # each position's turn, unwrapped (a plain turn is at most 1)
    angles = torch.cat([torch.zeros_like(steps[:1]), (steps - 2 * math.pi * torch.round(steps / (2 * math.pi)))
                        .cumsum(0)]) + torch.atan2(sin[:1], cos[:1])
    positions = torch.arange(len(angles), dtype=torch.float64)[:, None]
    turns = (positions * angles).sum(0) / (positions**2).sum()
    if (angles - positions * turns).abs().max() > 0.05 or abs(turns[0] - 1) > 1e-3 or (turns <= 0).any():
        return None
    columns = torch.arange(len(turns), dtype=torch.float64)
    logs = turns.log()
    slope = (columns * logs).sum() / (columns**2).sum()  # log turn = -(2i / dim) log base
    if (logs - slope * columns).abs().max() > 1e-2:
        return None  # another curve: Llama 3's, YaRN's, a linear scaling's
    return math.exp(-float(slope) * len(turns))


def _rounded(value: float, tolerance: float) -> float:
    """`value` with the fewest digits within `tolerance` of it (relative)."""
    return next((float(round(value, -e)) for e in range(int(math.log10(value)), -1, -1)
                 if abs(round(value, -e) - value) <= tolerance * value), value)


def _rope_parameters(default, layers: dict[int, tuple[float, float] | None], layer_types) -> dict | None:
    """The config's `rope_parameters` (the class's `default`, one dict or one per layer kind) with the base and
    share the package's layers turn by, where every layer of a dict's turns alike by a plain rotary and the
    dict is the plain rotary's (`rope_type` "default"); None where nothing is told."""
    if not isinstance(default, dict) or not layers:
        return None
    by_kind = bool(default) and all(isinstance(params, dict) for params in default.values())
    if by_kind and layer_types is None:
        return None
    rope = copy.deepcopy(default)
    groups = rope.items() if by_kind else [(None, rope)]
    told = False
    for kind, params in groups:
        turned = {rotary for layer, rotary in layers.items() if kind is None or
                  (layer < len(layer_types) and layer_types[layer] == kind)}
        if len(turned) != 1 or None in turned or params.get("rope_type", "default") != "default":
            continue
        (base, share), = turned
        params["rope_theta"] = float(base)
        if abs(share - 1) > 1e-6 or "partial_rotary_factor" in params:
            params["partial_rotary_factor"] = share
        told = True
    return rope if told else None


# The tanh approximation of GELU goes by several names in transformers, all the same function.
_TANH_GELUS = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu_python_tanh")


def _activation_fields(graph: ir.Graph, config) -> dict:
    """The first layer's MLP activation, by its ops: x * sigmoid(x) (`silu`), GELU exact or by tanh, ReLU,
    squared ReLU (Nemotron's `relu2`); a tanh GELU keeps the class's name where the class's default is one."""
    ops = [(n.op_type, n) for n in graph if n.name.startswith("/model/layers.0/mlp/")
           and ("/act_fn/" in n.name or "/Relu2/" in n.name)]  # (Nemotron's square: .../mlp/square/Relu2/pow)
    kinds = [op for op, _ in ops]
    name = None
    if kinds == ["Sigmoid", "Mul"]:
        name = "silu"
    elif kinds in (["Gelu"], ["FastGelu"]):
        node = ops[0][1]
        tanh = node.op_type == "FastGelu" or ("approximate" in node.attributes
                                              and node.attributes["approximate"].as_string() == "tanh")
        name = "gelu_pytorch_tanh" if tanh else "gelu"
    elif kinds == ["Relu"]:
        name = "relu"
    elif kinds == ["Relu", "Pow"] and _scalar(ops[1][1]) == 2:
        name = "relu2"
    if name is None:
        return {}
    fields = {}
    for field in ("hidden_act", "hidden_activation"):
        default = getattr(config, field, None)
        fields[field] = default if name == "gelu_pytorch_tanh" and default in _TANH_GELUS else name
    return fields
