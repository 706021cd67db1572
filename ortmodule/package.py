"""Read an ONNX GenAI package folder into plain, typed data. No sessions here.

A package is the folder that onnxruntime-genai's model builder writes: `genai_config.json`, the
decoder graph (`model.onnx`, weights usually in `model.onnx.data`), tokenizer files, and for
multimodal models more graphs beside the decoder. Every problem is a `PackageError` that names
the folder, the file and the key.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import onnx

CONFIG_FILE = "genai_config.json"

logger = logging.getLogger("ortmodule")


class PackageError(ValueError):
    """A GenAI package folder is missing something or holds something ortmodule cannot use."""


class NotSupportedError(NotImplementedError, AttributeError):
    """A part of transformers' model surface that an ONNX package cannot offer. It is an
    AttributeError too, so that `hasattr(model, name)` and `getattr(model, name, None)` say no."""


@dataclass(frozen=True)
class LayerKV:
    """Names and shape of one layer's KV cache (layers may differ in heads and head size)."""

    past_key: str
    past_value: str
    present_key: str
    present_value: str
    num_kv_heads: int
    head_size: int
    window: int | None = None  # sliding-window layers keep a cache of this many positions


@dataclass(frozen=True)
class LayerState:
    """Names and shape of one layer's state in a hybrid decoder (states.py), carried from run to run
    beside the attention layers' KV: a causal convolution's last inputs, `[batch, channels, width]`
    (LFM2's convolution layers, Qwen3.5's linear attention), or a linear attention's recurrent state,
    `[batch, heads, key size, value size]` (Qwen3.5's)."""

    past: str
    present: str
    shape: tuple[int, ...]  # after the batch dimension
    layer: int
    kind: str = "conv"  # or "recurrent"


@dataclass(frozen=True)
class Embedding:
    """The embedding model of a multimodal package: token ids in, the decoder's inputs out.

    Text runs it with empty media features: every input but the ids gets a tensor of its rank and
    dtype with 0 in each dimension the graph leaves open. Its outputs feed the decoder inputs of
    the same role (`inputs_embeds`, `per_layer_inputs`, ...), device to device.
    """

    path: Path
    input_ids: str
    id_type: int
    empty_inputs: tuple[tuple[str, int, tuple[int, ...]], ...]  # (name, ONNX element type, shape)
    feeds: tuple[tuple[str, str], ...]  # (embedding output, decoder input)


@dataclass(frozen=True)
class DecoderGraph:
    """The decoder graph: where it is and what it takes and returns."""

    path: Path
    input_ids: str | None  # None when the decoder takes embeddings from the embedding model
    attention_mask: str | None
    position_ids: str | None
    logits: str
    layers: tuple[LayerKV, ...]
    id_type: int  # ONNX TensorProto element type of input_ids
    mask_type: int | None
    position_type: int | None
    kv_type: int
    logits_type: int
    weight_bytes: int  # its initializers' bytes as stored (parameters.count_parameters counts as transformers)
    position_rank: int = 2  # 3 for mRoPE decoders (Qwen-VL): position_ids [3, batch, sequence]
    shares_kv_buffer: bool = True  # GroupQueryAttention writes the present into the past's buffer
    # The model builder's MultiHeadAttention export (fp16 for a CPU) builds its causal mask over the
    # new tokens alone: a run of several new tokens over a past fails inside ONNX Runtime ("invalid
    # expand shape"), so such a package takes one new token at a time over a cache (`Decoder.step`).
    steps_one_token: bool = False
    states: tuple[LayerState, ...] = ()  # hybrid layers' states (states.py), beside the KV of `layers`


@dataclass(frozen=True)
class Package:
    """Everything ortmodule needs to know about a GenAI package, read once."""

    root: Path
    genai_config: dict
    decoder: DecoderGraph
    embedding: Embedding | None
    model_type: str
    vocab_size: int
    context_length: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_size: int
    num_hidden_layers: int
    bos_token_id: int | list[int] | None
    eos_token_id: int | list[int] | None
    pad_token_id: int | None
    search: dict

    @property
    def exported_for(self) -> str | None:
        """The execution provider named by genai_config's decoder session options (the builder writes
        the one it exported for: 'cuda', 'dml', 'webgpu', ...), or None (a CPU export names none)."""
        options = self.genai_config["model"]["decoder"].get("session_options")
        entries = options.get("provider_options") if isinstance(options, dict) else None
        for entry in entries if isinstance(entries, list) else ():
            if isinstance(entry, dict) and entry:
                return next(iter(entry))
        return None


def _get(section: dict, key: str, where: str, file: Path):
    if key not in section:
        raise PackageError(f"{file}: missing key '{where}{key}'")
    return section[key]


def _object(section: dict, key: str, where: str, file: Path, required: bool = True) -> dict:
    """`section[key]` as a JSON object (an empty one when optional and absent)."""
    if key not in section and not required:
        return {}
    value = _get(section, key, where, file)
    if not isinstance(value, dict):
        raise PackageError(f"{file}: '{where}{key}' must be a JSON object, got {json.dumps(value)[:80]}")
    return value


def _string(section: dict, key: str, where: str, file: Path) -> str:
    value = _get(section, key, where, file)
    if not isinstance(value, str) or not value:
        raise PackageError(f"{file}: '{where}{key}' must be a non-empty string, got {json.dumps(value)[:80]}")
    return value


def _positive_int(section: dict, key: str, where: str, file: Path, default=None) -> int:
    """`section[key]` as an integer >= 1 (`default` when absent, if given)."""
    if key not in section and default is not None:
        return default
    value = _get(section, key, where, file)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PackageError(f"{file}: '{where}{key}' must be a positive integer, got {json.dumps(value)[:80]}")
    return value


# The search fields that become generate()'s defaults (hf.SEARCH_DEFAULTS), of the JSON types onnxruntime-genai's
# parser takes for them (it refuses the others at load; their ranges are generate()'s to check).
_SEARCH_TYPES = {"do_sample": "bool", "top_k": "integer", "no_repeat_ngram_size": "integer", "num_beams": "integer",
                 "num_return_sequences": "integer", "temperature": "number", "top_p": "number",
                 "repetition_penalty": "number", "length_penalty": "number"}


def _search(search: dict, file: Path) -> dict:
    """The search section with its generation fields checked for their JSON types (integers written as 50.0
    taken as 50): a `PackageError` naming the field, where onnxruntime-genai refuses the package too and
    transformers' generate would take "yes" for do_sample or fail later naming no file."""
    checked = dict(search)
    for key, kind in _SEARCH_TYPES.items():
        if key not in search:
            continue
        value = search[key]
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
        if kind == "bool" and isinstance(value, bool) or kind == "number" and number:
            continue
        if kind == "integer" and number and float(value).is_integer():
            checked[key] = int(value)
            continue
        article = "an" if kind == "integer" else "a"
        raise PackageError(f"{file}: 'search.{key}' must be {article} {kind}, got {json.dumps(value)[:80]}")
    return checked


def _token_id(model: dict, key: str, file: Path, several: bool = True) -> int | list[int] | None:
    """`model[key]`, a special token's id: an integer, None (or absent), or where `several`, a list of
    integers (a model with several end-of-sequence tokens)."""
    value = model.get(key)

    def is_id(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if value is None or is_id(value) or several and isinstance(value, list) and all(map(is_id, value)):
        return value
    kind = "a token id or a list of token ids" if several else "a token id"
    raise PackageError(f"{file}: 'model.{key}' must be {kind}, got {json.dumps(value)[:80]}")


def _matrices(graph: onnx.GraphProto) -> dict[str, list[int]]:
    """The shapes of the graph's 2-D weights, by name (embedding tables, rotary tables)."""
    return {t.name: list(t.dims) for t in graph.initializer if len(t.dims) == 2}


def _check_hidden_size(graph: onnx.GraphProto, matrices: dict[str, list[int]], input_ids: str | None, hidden: int,
                       path: Path, config_path: Path) -> None:
    """The hidden size genai_config.json says is the width of the token embedding table the decoder
    looks `input_ids` up in (where it keeps a plain one), which hidden states and `inputs_embeds` take."""
    for node in graph.node:
        if node.op_type != "Gather" or list(node.input[1:]) != [input_ids] or node.input[0] not in matrices:
            continue
        table = matrices[node.input[0]]
        if table[1] != hidden and next((a.i for a in node.attribute if a.name == "axis"), 0) == 0:
            raise PackageError(f"{config_path}: model.decoder.hidden_size is {hidden} but the token embedding table of "
                               f"{path.name} is {table} (a config from another export?)")


def _load_graph(path: Path) -> onnx.GraphProto:
    """A graph's structure (weights left on disk), after checking that its external weight files
    exist and are long enough for every tensor they hold."""
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # noqa: BLE001  protobuf's DecodeError and others: a truncated or foreign file
        raise PackageError(f"{path}: not a readable ONNX graph ({type(e).__name__}: {e})") from None
    for location, end in _external_data(model.graph).items():
        data = path.parent / location
        if not data.is_file():
            raise PackageError(f"{path}: its weights file {data} does not exist")
        size = data.stat().st_size
        if size < end:
            raise PackageError(f"{data}: truncated ({size} bytes; the graph {path.name} reads up to byte {end})")
    return model.graph


def _external_data(graph: onnx.GraphProto) -> dict[str, int]:
    """The weight files a graph's initializers live in (their locations beside the graph), each with the
    byte its tensors read up to."""
    needed: dict[str, int] = {}
    for tensor in graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            entries = {e.key: e.value for e in tensor.external_data}
            end = int(entries.get("offset", 0)) + int(entries.get("length", 0))
            location = entries.get("location", "")
            needed[location] = max(needed.get(location, 0), end)
    return needed


def graph_files(package: Package) -> list[Path]:
    """Every graph genai_config names (the decoder, an embedding or vision model, ...), each once."""
    graphs, sections = [], [package.genai_config.get("model", {})]
    while sections:
        section = sections.pop()
        for key, value in section.items():
            if isinstance(value, dict):
                sections.append(value)
            elif isinstance(value, list):  # a pipeline's stages
                sections += [stage for stage in value if isinstance(stage, dict)]
            elif key == "filename" and isinstance(value, str) and (package.root / value).is_file():
                graphs.append(package.root / value)
    return list(dict.fromkeys(graphs))


def model_files(package: Package) -> list[Path]:
    """The files a package's sessions load: every graph genai_config names (`graph_files`) and the weight
    files those graphs read; not other files of the folder (another variant's graphs, copies)."""
    graphs = graph_files(package)
    files = set(graphs)
    for path in graphs:
        try:
            locations = _external_data(onnx.load(str(path), load_external_data=False).graph)
        except Exception:  # noqa: BLE001  a graph no session of this use reads (a text run's vision model)
            continue  # the file itself is still listed
        files.update(path.parent / location for location in locations if (path.parent / location).is_file())
    return sorted(files)


def _dims(value_info: onnx.ValueInfoProto) -> list[int | str | None]:
    dims = []
    for d in value_info.type.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            dims.append(d.dim_value)
        elif d.HasField("dim_param"):
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return dims


def _elem_type(value_info: onnx.ValueInfoProto) -> int:
    return value_info.type.tensor_type.elem_type


# Bits an element of each initializer type takes (others: 32).
_ELEMENT_BITS = {onnx.TensorProto.DOUBLE: 64, onnx.TensorProto.INT64: 64, onnx.TensorProto.FLOAT16: 16,
                 onnx.TensorProto.BFLOAT16: 16, onnx.TensorProto.INT16: 16, onnx.TensorProto.UINT16: 16,
                 onnx.TensorProto.INT8: 8, onnx.TensorProto.UINT8: 8, onnx.TensorProto.BOOL: 8,
                 onnx.TensorProto.INT4: 4, onnx.TensorProto.UINT4: 4}


def _weight_bytes(graph: onnx.GraphProto) -> int:
    """The bytes of a graph's initializers as stored (quantized weights packed)."""
    return sum(math.prod(t.dims) * _ELEMENT_BITS.get(t.data_type, 32) for t in graph.initializer) // 8


class _Shape(NamedTuple):
    """The decoder's dimensions as genai_config.json gives them."""

    num_layers: int
    head_size: int
    num_heads: int
    num_kv_heads: int
    hidden_size: int


def read_package(path: str | Path) -> Package:
    """Read and check a GenAI package folder; raise `PackageError` naming what is wrong."""
    root = Path(path)
    if not root.exists():
        raise PackageError(f"package folder not found: {root}")
    if not root.is_dir():
        hint = f"; a GGUF file exports to one with `ortmodule export {root} OUT`" if root.suffix == ".gguf" else ""
        if (root.parent / "genai_config.json").is_file():  # a file of the package, its model.onnx say
            hint = f"; the folder of this file is one: {root.parent}"
        raise PackageError(f"not a folder: {root} (expected a GenAI package folder{hint})")
    config_path, genai = _read_config(root)
    model = _object(genai, "model", "", config_path)
    dec = _object(model, "decoder", "model.", config_path)
    shape = _read_shape(dec, config_path)
    search = _search(_object(genai, "search", "", config_path, required=False), config_path)
    context_length = _positive_int(model, "context_length", "model.", config_path)
    decoder, embedding, vocab_size, table_rows = _read_decoder(root, model, shape, config_path)
    if table_rows is not None and table_rows < context_length:
        logger.warning("ortmodule: %s says model.context_length is %d, but the rotary position tables of %s have %d "
                       "rows (positions past them fail inside ONNX Runtime); the context length is taken as %d",
                       config_path, context_length, decoder.path.relative_to(root), table_rows, table_rows)
        context_length = table_rows
    return Package(
        root=root,
        genai_config=genai,
        decoder=decoder,
        embedding=embedding,
        model_type=model.get("type", ""),
        vocab_size=vocab_size,
        context_length=context_length,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_size=shape.head_size,
        num_hidden_layers=shape.num_layers,
        bos_token_id=_token_id(model, "bos_token_id", config_path),
        eos_token_id=_token_id(model, "eos_token_id", config_path),
        pad_token_id=_token_id(model, "pad_token_id", config_path, several=False),
        search=search,
    )


def not_a_package(names: list[str], source: str) -> str:
    """What a folder or Hub repository holding the files `names` (paths inside it, no genai_config.json)
    is instead of a GenAI package, and what to do, as the rest of an error message."""
    onnx = any(name.endswith(".onnx") for name in names)
    weights = any(name.endswith((".safetensors", ".bin", ".pth", ".gguf")) for name in names)
    if onnx and not weights:
        return (": ONNX files of another exporter (Optimum's or transformers.js's, as the onnx-community repositories "
                "hold), which neither onnxruntime-genai nor ortmodule loads; export the model's Hugging Face "
                "checkpoint with `ortmodule export CHECKPOINT OUT` (docs/usage.md)")
    if "config.json" in names or any(name.endswith(".gguf") for name in names):
        return (f": a Hugging Face checkpoint or GGUF file, not a GenAI package; make one with `ortmodule export "
                f"{source} OUT` (docs/usage.md)")
    return "; is this a GenAI package?"


def _read_config(root: Path) -> tuple[Path, dict]:
    config_path = root / CONFIG_FILE
    if not config_path.is_file():
        inside = sorted(str(found.parent.relative_to(root)) for depth in ("*/", "*/*/", "*/*/*/")
                        for found in root.glob(depth + CONFIG_FILE))
        if inside:  # a download of several packages (one per device and precision), as on the Hub
            raise PackageError(f"{root}: no {CONFIG_FILE} in the folder, but packages in its subfolders: "
                               f"{', '.join(inside)} (load one of them, or pass subfolder=: --subfolder on the "
                               "command line)")
        names = [str(path.relative_to(root)) for depth in ("*", "*/*") for path in root.glob(depth)]
        raise PackageError(f"{root}: no {CONFIG_FILE} in the folder{not_a_package(names, str(root))}")
    try:
        genai = json.loads(config_path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise PackageError(f"{config_path}: not UTF-8 text ({e})") from None
    except json.JSONDecodeError as e:
        raise PackageError(f"{config_path}: not valid JSON ({e})") from None
    if not isinstance(genai, dict):
        raise PackageError(f"{config_path}: must hold a JSON object, got {type(genai).__name__}")
    return config_path, genai


def _read_shape(dec: dict, config_path: Path) -> _Shape:
    where = "model.decoder."
    num_layers = _positive_int(dec, "num_hidden_layers", where, config_path)
    head_size = _positive_int(dec, "head_size", where, config_path)
    num_heads = _positive_int(dec, "num_attention_heads", where, config_path)
    num_kv_heads = _positive_int(dec, "num_key_value_heads", where, config_path, default=num_heads)
    hidden_size = _positive_int(dec, "hidden_size", where, config_path, default=num_heads * head_size)
    return _Shape(num_layers, head_size, num_heads, num_kv_heads, hidden_size)


class _Graph(NamedTuple):
    """A decoder graph's file, inputs and outputs, and the config section naming them."""

    path: Path
    proto: onnx.GraphProto
    inputs: dict
    outputs: dict
    names_in: dict
    names_out: dict
    config_path: Path

    def input_named(self, key: str, required: bool) -> str | None:
        name = self.names_in.get(key, key)
        if name in self.inputs:
            return name
        if required:
            raise PackageError(
                f"{self.config_path}: model.decoder.inputs.{key} is '{name}', which is not an input "
                f"of {self.path.name} (inputs: {', '.join(self.inputs)})"
            )
        return None


def _read_decoder(root: Path, model: dict, shape: _Shape,
                  config_path: Path) -> tuple[DecoderGraph, Embedding | None, int, int | None]:
    """The decoder graph as genai_config.json describes it, its embedding model, the vocabulary size, the
    rows of its rotary position tables (`_position_table_rows`)."""
    dec = model["decoder"]
    filename = _string(dec, "filename", "model.decoder.", config_path)
    path = root / filename
    if not path.is_file():
        raise PackageError(f"{config_path}: model.decoder.filename is '{filename}' but {path} does not exist")
    _check_state_kinds(dec, config_path)
    proto = _load_graph(path)
    graph = _Graph(path, proto, {i.name: i for i in proto.input}, {o.name: o for o in proto.output},
                   _object(dec, "inputs", "model.decoder.", config_path),
                   _object(dec, "outputs", "model.decoder.", config_path), config_path)
    input_ids, embedding = _token_input(root, model, graph)
    attention_mask = graph.input_named("attention_mask", required=False)
    position_ids = graph.input_named("position_ids", required=False)
    position_rank = len(_dims(graph.inputs[position_ids])) if position_ids else 2
    if position_rank == 3 and plain_rotary_positions(proto, position_ids):
        position_rank = 2  # graph.py's repair gives the rotary nodes the 2-D ids they take
    if position_rank not in (2, 3):
        raise PackageError(f"{path}: position_ids has rank {position_rank}; expected 2 or 3 (mRoPE)")
    logits, vocab_size = _read_logits(model, graph)
    matrices = _matrices(proto)
    _check_hidden_size(proto, matrices, input_ids, shape.hidden_size, path, config_path)
    _check_attention(proto, shape.num_heads, shape.num_kv_heads, path, config_path)
    states = _read_states(dec, graph)
    layers = _read_layers(dec, shape, graph, {state.layer for state in states}, str(model.get("type", "")))
    _check_windows(proto, layers, path, config_path)
    kv_type = _elem_type(graph.inputs[layers[0].past_key]) if layers else onnx.TensorProto.FLOAT
    if any(_elem_type(graph.inputs[state.past]) != kv_type for state in states):
        raise PackageError(f"{path}: its layers' states are not of its KV cache's element type, which ortmodule's "
                           "cache assumes (an export ortmodule does not know)")
    known = {input_ids, attention_mask, position_ids} | {name for kv in layers for name in (kv.past_key, kv.past_value)}
    known |= {state.past for state in states}
    known |= {decoder_input for _, decoder_input in embedding.feeds} if embedding else set()
    unknown = [name for name in graph.inputs if name not in known]
    if unknown:
        raise PackageError(f"{path}: the decoder has inputs ortmodule does not know how to fill: {', '.join(unknown)}")
    decoder = DecoderGraph(
        path=path,
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits=logits,
        layers=layers,
        id_type=_elem_type(graph.inputs[input_ids]) if input_ids else embedding.id_type,
        mask_type=_elem_type(graph.inputs[attention_mask]) if attention_mask else None,
        position_type=_elem_type(graph.inputs[position_ids]) if position_ids else None,
        kv_type=kv_type,
        logits_type=_elem_type(graph.outputs[logits]),
        weight_bytes=_weight_bytes(proto),
        position_rank=position_rank,
        shares_kv_buffer=any(node.op_type == "GroupQueryAttention" for node in proto.node),
        steps_one_token=_attends_with_multihead(proto),
        states=states,
    )
    return decoder, embedding, vocab_size, _position_table_rows(proto, matrices)


def plain_rotary_positions(graph: onnx.GraphProto, name: str) -> bool:
    """Whether the 3-D (mRoPE) position ids input `name` feeds only `com.microsoft` RotaryEmbedding nodes,
    which take 1-D or 2-D ids: the builder's Qwen3.5 export declares `[3, batch, sequence]` but rotates by
    plain RoPE (its rotary tables have no sections), so its text positions are the 2-D ids `[batch,
    sequence]` (all three rows are equal for text). graph.py's repair makes the input 2-D."""
    users = [(node, i) for node in graph.node for i, value in enumerate(node.input) if value == name]
    return bool(users) and all((node.domain, node.op_type, i) == ("com.microsoft", "RotaryEmbedding", 1)
                               for node, i in users)


# Where attention ops read rotary cos and sin tables ([positions, rotary width / 2], one row a position).
_ROTARY_TABLE_INPUTS = {
    ("GroupQueryAttention", "com.microsoft"): (7, 8),
    ("RotaryEmbedding", "com.microsoft"): (2, 3),
    ("RotaryEmbedding", ""): (1, 2),
}


def _position_table_rows(graph: onnx.GraphProto, matrices: dict[str, list[int]]) -> int | None:
    """The positions the decoder's rotary tables hold, where the graph keeps them as weights: the
    tables GroupQueryAttention or RotaryEmbedding reads, or (mobius-onnx's decoders) the cos and sin
    caches a Gather looks positions up in. mobius-onnx writes a context length of at least 4096
    whatever the model's `max_position_embeddings` (the rows it builds), so its packages of
    shorter-context models say more than they can take. None where the graph keeps no such table (the
    builder's long-context Phi-3 chooses one with an If)."""
    tables = set()
    for node in graph.node:
        slots = _ROTARY_TABLE_INPUTS.get((node.op_type, node.domain), ())
        tables.update(node.input[i] for i in slots if i < len(node.input))
        if node.op_type == "Gather" and node.input and re.search(r"(cos|sin)_cache", node.input[0]):
            tables.add(node.input[0])
    found = [matrices[name][0] for name in tables if name in matrices]
    return min(found) if found else None


def _attends_with_multihead(graph: onnx.GraphProto) -> bool:
    """Whether the decoder attends with MultiHeadAttention and not GroupQueryAttention (the model
    builder's fp16 export for a CPU)."""
    kinds = {node.op_type for node in graph.node if node.domain == "com.microsoft"}
    return "MultiHeadAttention" in kinds and "GroupQueryAttention" not in kinds


def _check_windows(graph: onnx.GraphProto, layers: tuple[LayerKV, ...], path: Path, config_path: Path) -> None:
    """Sliding-window layers need an attention that applies the window: GroupQueryAttention's
    `local_window_size`. The model builder's fp16 export for a CPU attends with MultiHeadAttention,
    which sees every past position: its logits past the window would be another model's."""
    windows = sorted({kv.window for kv in layers if kv.window})
    if windows and _attends_with_multihead(graph):
        raise PackageError(
            f"{config_path}: model.decoder.sliding_window gives layers a window of {windows[0]} tokens, but "
            f"{path.name} attends with MultiHeadAttention, which sees every past position (the model builder's "
            "fp16 export for a CPU does this): its logits past the window would be wrong. Export the model in "
            "fp32 or int4 for a CPU, or in fp16 or bf16 for CUDA")


# What the model builder's decoders may keep between runs besides attention's keys and values
# (genai_config's decoder inputs), which ortmodule's cache does not hold.
_OTHER_STATES = {
    "past_key_scale_names": "a quantized KV cache (keys and values with their scales)",
    "block_table": "a paged KV cache (the builder's paged-attention export)",
}


def _check_state_kinds(dec: dict, config_path: Path) -> None:
    """PackageError where the decoder keeps a state ortmodule's KV cache does not hold."""
    inputs = dec.get("inputs") if isinstance(dec.get("inputs"), dict) else {}
    for key, what in _OTHER_STATES.items():
        if key in inputs:
            types = dec.get("layer_types")
            kinds = sorted({t for t in types if "attention" not in str(t)}) if isinstance(types, list) else []
            at = {kind: ", ".join(str(i) for i, t in enumerate(types) if t == kind) for kind in kinds}
            layers = "".join(f"; layer_types: {kind} at layers {where}" for kind, where in at.items())
            raise PackageError(
                f"{config_path}: model.decoder.inputs.{key}: the decoder keeps {what}{layers}. ortmodule does not "
                "run such packages (its cache holds attention keys and values, and convolution and linear-attention "
                "states); onnxruntime-genai's Generator runs them"
            )


def _token_input(root: Path, model: dict, graph: _Graph) -> tuple[str | None, Embedding | None]:
    """The decoder's token-id input, or the embedding model that feeds it instead."""
    if graph.input_named("input_ids", required=False) is None and "embedding" in model:
        return None, _read_embedding(root, model, graph.config_path, graph.names_in, graph.inputs)
    if "inputs_embeds" in graph.inputs and "input_ids" not in graph.inputs:
        raise PackageError(
            f"{graph.config_path}: the decoder takes inputs_embeds, not input_ids, and there is no "
            "'model.embedding' section naming the embedding model that makes them"
        )
    return graph.input_named("input_ids", required=True), None


def _read_logits(model: dict, graph: _Graph) -> tuple[str, int]:
    """The logits output's name and the vocabulary size (genai_config's, checked against the graph's)."""
    logits = graph.names_out.get("logits", "logits")
    if logits not in graph.outputs:
        hint = ("; the decoder returns hidden states instead of logits, as the model builder's exclude_lm_head "
                "makes it: re-export without exclude_lm_head") if "hidden_states" in graph.outputs else ""
        raise PackageError(
            f"{graph.config_path}: model.decoder.outputs.logits is '{logits}', which is not an output of "
            f"{graph.path.name} (outputs: {', '.join(graph.outputs)}){hint}"
        )
    dims = _dims(graph.outputs[logits])
    if len(dims) != 3 or dims[1] == 1:
        raise PackageError(
            f"{graph.path}: output '{logits}' has shape {dims}; its logits are pruned to the "
            "last position, so continuations cannot be scored. Re-export without prune_lm_head."
        )
    graph_vocab = dims[2] if isinstance(dims[2], int) else None
    vocab_size = _positive_int(model, "vocab_size", "model.", graph.config_path, default=graph_vocab)
    if graph_vocab is not None and vocab_size != graph_vocab:
        raise PackageError(
            f"{graph.config_path}: model.vocab_size is {vocab_size} but the decoder's '{logits}' output has "
            f"{graph_vocab} logits per position ({graph.path.name})"
        )
    return logits, vocab_size


_KV_NAMES = [("inputs", "past_key_names"), ("inputs", "past_value_names"),
             ("outputs", "present_key_names"), ("outputs", "present_value_names")]


# A hybrid decoder's states (genai_config's templates): (past, present, kind, rank after the batch, what they are)
_STATE_NAMES = (("past_conv_names", "present_conv_names", "conv", 2, "convolution state", "[batch, channels, width]"),
                ("past_recurrent_names", "present_recurrent_names", "recurrent", 3, "recurrent state",
                 "[batch, heads, key size, value size]"))


def _read_states(dec: dict, graph: _Graph) -> tuple[LayerState, ...]:
    """The hybrid layers' states (genai_config's `past_conv_names` / `present_conv_names` and
    `past_recurrent_names` / `present_recurrent_names` templates, for the layers whose name is an input
    of the graph), each of a fixed shape after the batch; layer by layer, convolutions first."""
    where = graph.config_path
    states = []
    for past_key, present_key, kind, rank, what, form in _STATE_NAMES:
        if past_key not in graph.names_in:
            continue
        past = _get(graph.names_in, past_key, "model.decoder.inputs.", where)
        present = _get(graph.names_out, present_key, "model.decoder.outputs.", where)
        found = []
        for i in range(_positive_int(dec, "num_hidden_layers", "model.decoder.", where)):
            if past % i not in graph.inputs:
                continue
            if present % i not in graph.outputs:
                raise PackageError(f"{where}: model.decoder.outputs.{present_key} '{present}' gives '{present % i}' "
                                   f"for layer {i}, which is not an output of {graph.path.name}")
            dims = _dims(graph.inputs[past % i])
            if len(dims) != rank + 1 or not all(isinstance(d, int) and d > 0 for d in dims[1:]):
                raise PackageError(f"{graph.path}: {what} '{past % i}' has shape {dims}; expected {form} with "
                                   "fixed sizes after the batch")
            found.append(LayerState(past % i, present % i, tuple(dims[1:]), i, kind))
        if not found:
            raise PackageError(f"{where}: model.decoder.inputs.{past_key} '{past}' names no input of "
                               f"{graph.path.name} for any layer")
        states += found
    return tuple(sorted(states, key=lambda state: (state.layer, state.kind != "conv")))


def _read_layers(dec: dict, shape: _Shape, graph: _Graph, other: set = frozenset(),
                 model_type: str = "") -> tuple[LayerKV, ...]:
    """Each layer's KV input and output names (from genai_config's templates) and shape; the layers in
    `other` (a hybrid decoder's stateful layers) keep no KV, nor do Gemma 4's last layers that
    reuse an earlier layer's (`num_kv_shared_layers`: the graph has no KV for them, `_kv_layers`)."""
    sliding = dec.get("sliding_window") or {}
    sliding_layers = set(sliding.get("layers", range(shape.num_layers))) if sliding else set()
    tables = {"inputs": (graph.names_in, graph.inputs), "outputs": (graph.names_out, graph.outputs)}
    templates = {key: _get(tables[section][0], key, f"model.decoder.{section}.", graph.config_path)
                 for section, key in _KV_NAMES}
    layers = []
    for i in range(_kv_layers(shape.num_layers, templates["past_key_names"], graph, model_type)):
        if i in other:
            continue
        names = []
        for section, key in _KV_NAMES:
            name = templates[key] % i
            if name not in tables[section][1]:
                raise PackageError(
                    f"{graph.config_path}: model.decoder.{section}.{key} '{templates[key]}' gives '{name}' for "
                    f"layer {i}, which is not an {section[:-1]} of {graph.path.name}"
                )
            names.append(name)
        dims = _dims(graph.inputs[names[0]])
        if len(dims) != 4:
            raise PackageError(
                f"{graph.path}: KV input '{names[0]}' has rank {len(dims)}, expected 4 "
                "[batch, kv_heads, past_length, head_size]"
            )
        heads = dims[1] if isinstance(dims[1], int) else shape.num_kv_heads
        size = dims[3] if isinstance(dims[3], int) else shape.head_size  # builder 0.18 writes 'kv_cache_dim'
        window = sliding.get("window_size") if i in sliding_layers else None
        layers.append(LayerKV(*names, heads, size, window))
    return tuple(layers)


def _kv_layers(count: int, past_keys: str, graph: _Graph, model_type: str) -> int:
    """The layers with KV of their own: all `count`, except in a Gemma 4 graph whose last layers have
    no KV input (mobius-onnx's export of `num_kv_shared_layers`, which reuse an earlier layer's keys
    and values): the layers before the first without."""
    if not model_type.startswith("gemma4"):
        return count
    own = [past_keys % i in graph.inputs for i in range(count)]
    first = own.index(False) if False in own else count
    if first == 0 or any(own[first:]):
        return count  # not that form: the first missing name is an error below
    logger.info("ortmodule: %s has KV inputs for its first %d of %d layers (the rest reuse earlier layers' keys "
                "and values)", graph.path, first, count)
    return first


def _read_embedding(root: Path, model: dict, config_path: Path, decoder_names: dict, decoder_inputs: dict) -> Embedding:
    """The `model.embedding` section and its graph (the vision and speech models are not read)."""
    section = _object(model, "embedding", "model.", config_path)
    filename = _string(section, "filename", "model.embedding.", config_path)
    path = root / filename
    if not path.is_file():
        raise PackageError(f"{config_path}: model.embedding.filename is '{filename}' but {path} does not exist")
    graph = _load_graph(path)
    inputs = {i.name: i for i in graph.input}
    outputs = {o.name for o in graph.output}
    names_in, names_out = section.get("inputs", {}), section.get("outputs", {})
    ids = names_in.get("input_ids", "input_ids")
    if ids not in inputs:
        raise PackageError(
            f"{config_path}: model.embedding.inputs.input_ids is '{ids}', which is not an input of "
            f"{filename} (inputs: {', '.join(inputs)})"
        )
    empty = []
    for name, value in inputs.items():
        if name != ids:
            shape = tuple(d if isinstance(d, int) else 0 for d in _dims(value))
            empty.append((name, _elem_type(value), shape))
    # An output feeds the decoder input of the same role: genai_config's keys first, then names.
    feeds = []
    for output in outputs:
        role = next((key for key, name in names_out.items() if name == output), output)
        target = decoder_names.get(role, role)
        if target in decoder_inputs:
            feeds.append((output, target))
    if not feeds:
        raise PackageError(
            f"{path}: none of the embedding model's outputs ({', '.join(sorted(outputs))}) is an input "
            f"of the decoder ({', '.join(decoder_inputs)})"
        )
    return Embedding(path, ids, _elem_type(inputs[ids]), tuple(empty), tuple(sorted(feeds)))


def _check_attention(graph: onnx.GraphProto, num_heads: int, num_kv_heads: int, path: Path, config_path: Path) -> None:
    """genai_config's head counts against the first GroupQueryAttention node's own attributes."""
    node = next((n for n in graph.node if n.op_type == "GroupQueryAttention"), None)
    if node is None:
        return
    attributes = {a.name: a.i for a in node.attribute if a.name in ("num_heads", "kv_num_heads")}
    for key, value, attribute in (("num_attention_heads", num_heads, "num_heads"),
                                  ("num_key_value_heads", num_kv_heads, "kv_num_heads")):
        if attribute in attributes and attributes[attribute] != value:
            raise PackageError(
                f"{config_path}: model.decoder.{key} is {value} but {path.name}'s attention node "
                f"'{node.name}' has {attribute}={attributes[attribute]}"
            )
