"""Read an ONNX GenAI package folder into plain, typed data. No sessions here.

A package is the folder that onnxruntime-genai's model builder writes: `genai_config.json`, the
decoder graph (`model.onnx`, weights usually in `model.onnx.data`), tokenizer files, and for
multimodal models more graphs beside the decoder. Every problem is a `PackageError` that names
the folder, the file and the key.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import onnx

CONFIG_FILE = "genai_config.json"


class PackageError(ValueError):
    """A GenAI package folder is missing something or holds something ortmodule cannot use."""


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
class Decoder:
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
    num_parameters: int
    position_rank: int = 2  # 3 for mRoPE decoders (Qwen-VL): position_ids [3, batch, sequence]
    shares_kv_buffer: bool = True  # GroupQueryAttention writes the present into the past's buffer


@dataclass(frozen=True)
class Package:
    """Everything ortmodule needs to know about a GenAI package, read once."""

    root: Path
    genai_config: dict
    decoder: Decoder
    embedding: Embedding | None
    model_type: str
    vocab_size: int
    context_length: int
    hidden_size: int
    num_attention_heads: int
    bos_token_id: int | list[int] | None
    eos_token_id: int | list[int] | None
    pad_token_id: int | None
    search: dict


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


def _load_graph(path: Path) -> onnx.GraphProto:
    """A graph's structure (weights left on disk), after checking that its external weight files
    exist and are long enough for every tensor they hold."""
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf's DecodeError and others: a truncated or foreign file
        raise PackageError(f"{path}: not a readable ONNX graph ({type(e).__name__}: {e})") from None
    needed: dict[str, int] = {}
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            entries = {e.key: e.value for e in tensor.external_data}
            end = int(entries.get("offset", 0)) + int(entries.get("length", 0))
            location = entries.get("location", "")
            needed[location] = max(needed.get(location, 0), end)
    for location, end in needed.items():
        data = path.parent / location
        if not data.is_file():
            raise PackageError(f"{path}: its weights file {data} does not exist")
        size = data.stat().st_size
        if size < end:
            raise PackageError(f"{data}: truncated ({size} bytes; the graph {path.name} reads up to byte {end})")
    return model.graph


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


def _count_parameters(graph: onnx.GraphProto) -> int:
    return sum(math.prod(t.dims) for t in graph.initializer)


def read_package(path: str | Path) -> Package:
    """Read and check a GenAI package folder; raise `PackageError` naming what is wrong."""
    root = Path(path)
    if not root.exists():
        raise PackageError(f"package folder not found: {root}")
    if not root.is_dir():
        raise PackageError(f"not a folder: {root} (expected a GenAI package folder)")
    config_path = root / CONFIG_FILE
    if not config_path.is_file():
        raise PackageError(f"{root}: no {CONFIG_FILE} in the folder; is this a GenAI package?")
    try:
        genai = json.loads(config_path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise PackageError(f"{config_path}: not UTF-8 text ({e})") from None
    except json.JSONDecodeError as e:
        raise PackageError(f"{config_path}: not valid JSON ({e})") from None
    if not isinstance(genai, dict):
        raise PackageError(f"{config_path}: must hold a JSON object, got {type(genai).__name__}")

    model = _object(genai, "model", "", config_path)
    dec = _object(model, "decoder", "model.", config_path)
    filename = _string(dec, "filename", "model.decoder.", config_path)
    decoder_path = root / filename
    if not decoder_path.is_file():
        raise PackageError(
            f"{config_path}: model.decoder.filename is '{filename}' but {decoder_path} does not exist"
        )
    num_layers = _positive_int(dec, "num_hidden_layers", "model.decoder.", config_path)
    head_size = _positive_int(dec, "head_size", "model.decoder.", config_path)
    num_heads = _positive_int(dec, "num_attention_heads", "model.decoder.", config_path)
    num_kv_heads = _positive_int(dec, "num_key_value_heads", "model.decoder.", config_path, default=num_heads)
    names_in = _object(dec, "inputs", "model.decoder.", config_path)
    names_out = _object(dec, "outputs", "model.decoder.", config_path)
    search = _object(genai, "search", "", config_path, required=False)
    context_length = _positive_int(model, "context_length", "model.", config_path)

    graph = _load_graph(decoder_path)
    graph_inputs = {i.name: i for i in graph.input}
    graph_outputs = {o.name: o for o in graph.output}

    def input_named(key: str, required: bool) -> str | None:
        name = names_in.get(key, key)
        if name not in graph_inputs:
            if required:
                raise PackageError(
                    f"{config_path}: model.decoder.inputs.{key} is '{name}', which is not an input "
                    f"of {decoder_path.name} (inputs: {', '.join(graph_inputs)})"
                )
            return None
        return name

    embedding = None
    if input_named("input_ids", required=False) is None and "embedding" in model:
        embedding = _read_embedding(root, model, config_path, names_in, graph_inputs)
        input_ids = None
    elif "inputs_embeds" in graph_inputs and "input_ids" not in graph_inputs:
        raise PackageError(
            f"{config_path}: the decoder takes inputs_embeds, not input_ids, and there is no "
            "'model.embedding' section naming the embedding model that makes them"
        )
    else:
        input_ids = input_named("input_ids", required=True)
    attention_mask = input_named("attention_mask", required=False)
    position_ids = input_named("position_ids", required=False)
    position_rank = len(_dims(graph_inputs[position_ids])) if position_ids else 2
    if position_rank not in (2, 3):
        raise PackageError(f"{decoder_path}: position_ids has rank {position_rank}; expected 2 or 3 (mRoPE)")

    logits = names_out.get("logits", "logits")
    if logits not in graph_outputs:
        raise PackageError(
            f"{config_path}: model.decoder.outputs.logits is '{logits}', which is not an output of "
            f"{decoder_path.name} (outputs: {', '.join(graph_outputs)})"
        )
    logits_dims = _dims(graph_outputs[logits])
    if len(logits_dims) != 3 or logits_dims[1] == 1:
        raise PackageError(
            f"{decoder_path}: output '{logits}' has shape {logits_dims}; its logits are pruned to the "
            "last position, so continuations cannot be scored. Re-export without prune_lm_head."
        )
    graph_vocab = logits_dims[2] if isinstance(logits_dims[2], int) else None
    vocab_size = _positive_int(model, "vocab_size", "model.", config_path, default=graph_vocab)
    if graph_vocab is not None and vocab_size != graph_vocab:
        raise PackageError(
            f"{config_path}: model.vocab_size is {vocab_size} but the decoder's '{logits}' output has "
            f"{graph_vocab} logits per position ({decoder_path.name})"
        )
    _check_attention(graph, num_heads, num_kv_heads, decoder_path, config_path)

    sliding = dec.get("sliding_window") or {}
    sliding_layers = set(sliding.get("layers", range(num_layers))) if sliding else set()
    layers = []
    templates = {
        key: _get(table, key, f"model.decoder.{section}.", config_path)
        for table, section, key in [
            (names_in, "inputs", "past_key_names"),
            (names_in, "inputs", "past_value_names"),
            (names_out, "outputs", "present_key_names"),
            (names_out, "outputs", "present_value_names"),
        ]
    }
    for i in range(num_layers):
        names = {}
        for key, template in templates.items():
            name = template % i
            table = graph_inputs if key.startswith("past") else graph_outputs
            if name not in table:
                section = "inputs" if key.startswith("past") else "outputs"
                raise PackageError(
                    f"{config_path}: model.decoder.{section}.{key} '{template}' gives '{name}' for "
                    f"layer {i}, which is not an {section[:-1]} of {decoder_path.name}"
                )
            names[key] = name
        dims = _dims(graph_inputs[names["past_key_names"]])
        if len(dims) != 4:
            raise PackageError(
                f"{decoder_path}: KV input '{names['past_key_names']}' has rank {len(dims)}, expected 4 "
                "[batch, kv_heads, past_length, head_size]"
            )
        heads = dims[1] if isinstance(dims[1], int) else num_kv_heads
        size = dims[3] if isinstance(dims[3], int) else head_size  # builder 0.18 writes 'kv_cache_dim'
        layers.append(
            LayerKV(
                names["past_key_names"], names["past_value_names"],
                names["present_key_names"], names["present_value_names"], heads, size,
                sliding.get("window_size") if i in sliding_layers else None,
            )
        )

    known = {input_ids, attention_mask, position_ids} | {name for kv in layers for name in (kv.past_key, kv.past_value)}
    known |= {decoder_input for _, decoder_input in embedding.feeds} if embedding else set()
    unknown = [name for name in graph_inputs if name not in known]
    if unknown:
        raise PackageError(
            f"{decoder_path}: the decoder has inputs ortmodule does not know how to fill: {', '.join(unknown)}"
        )
    decoder = Decoder(
        path=decoder_path,
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits=logits,
        layers=tuple(layers),
        id_type=_elem_type(graph_inputs[input_ids]) if input_ids else embedding.id_type,
        mask_type=_elem_type(graph_inputs[attention_mask]) if attention_mask else None,
        position_type=_elem_type(graph_inputs[position_ids]) if position_ids else None,
        kv_type=_elem_type(graph_inputs[layers[0].past_key]) if layers else onnx.TensorProto.FLOAT,
        logits_type=_elem_type(graph_outputs[logits]),
        num_parameters=_count_parameters(graph),
        position_rank=position_rank,
        shares_kv_buffer=any(node.op_type == "GroupQueryAttention" for node in graph.node),
    )
    return Package(
        root=root,
        genai_config=genai,
        decoder=decoder,
        embedding=embedding,
        model_type=model.get("type", ""),
        vocab_size=vocab_size,
        context_length=context_length,
        hidden_size=dec.get("hidden_size", num_heads * head_size),
        num_attention_heads=num_heads,
        bos_token_id=model.get("bos_token_id"),
        eos_token_id=model.get("eos_token_id"),
        pad_token_id=model.get("pad_token_id"),
        search=search,
    )


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
