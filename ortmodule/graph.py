"""Rewrites of a decoder graph: the LM head applied only to the positions asked for.

The builder's decoders compute `logits [batch, seq, vocab]` for every position. Scoring reads a
handful of them, and on a large vocabulary the LM head is most of the model's work. The rewrite
adds an input `ortmodule_logits_indices` (int64 `[n]`, flat indices into `batch * seq`), gathers
those rows of the final hidden states just before the LM head (or, where the decoder's tail after
its last attention works position by position, before that tail: tail.py), and returns
`logits [n, vocab]`.
Where the graph's last step is a cast of half-precision logits to float32 (the builder's bf16
packages), the rewritten graph returns them before it: the same values in half the bytes
(`Decoder` hands callers of `forward` the package's float32, and scoring normalizes in float32);
or, with `rewrite_lm_head="float32"`, the head multiplies in float32: logits not rounded to bf16.

Both the rewritten graph and, without the rewrite (off, or skipped), the package's own (`repaired_graph`) lose the
shapes the model builder records wrongly for its `repeat_kv` values (the KV of past and new tokens
declared as long as the new tokens: ONNX Runtime's CPU planner then reuses a buffer too small for
them, and every decode step of an fp16 package on a CPU fails).

The rewritten graph references the package's own external weight file (no copy of the weights)
and is cached as graph bytes keyed by the source graph's content, each entry checked by its own
SHA-256 when read.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import threading
from pathlib import Path

import onnx
import onnx_ir as ir

from . import cache_folder, cpu_forms, states
from .cache_folder import cache_home
from .constants import is_constant
from .package import PackageError, plain_rotary_positions
from .projections import unpack_projections
from .tail import gather_tail

logger = logging.getLogger("ortmodule")

LOGITS_INDICES = "ortmodule_logits_indices"
REWRITE_VERSION = "8"
# The files whose code shapes a rewritten graph (this one's, the extend, prefill and variants.py's graphs): their
# bytes are a part of every cache key (`code_digest`), so that no entry made by other code is reused.
_REWRITE_SOURCES = ("graph.py", "projections.py", "tail.py", "constants.py", "extend.py", "states.py", "cpu_forms.py",
                    "hidden.py", "embeddings.py", "variants.py", "attentions.py")

# Ops allowed between the LM head and the logits output (casts, soft-capping: Div, Tanh, Mul).
_ELEMENTWISE = {"Cast", "Div", "Mul", "Tanh", "Add", "Sub", "Identity"}
_LM_HEADS = {"MatMul", "MatMulNBits", "Gemm"}


class RewriteSkipped(Exception):
    """The graph does not match the pattern; the reason is the message."""


def default_cache_dir() -> Path:
    return cache_home() / "graphs"


def find_lm_head(graph: ir.Graph, logits_name: str) -> tuple[ir.Node, list[ir.Node]]:
    """The node computing the logits from hidden states, and the elementwise nodes after it."""
    output = next((o for o in graph.outputs if o.name == logits_name), None)
    if output is None:
        raise RewriteSkipped(f"no graph output named '{logits_name}'")
    chain = []
    node = output.producer()
    while node is not None and node.domain in ("", "ai.onnx") and node.op_type in _ELEMENTWISE:
        variable = [v for v in node.inputs if v is not None and not is_constant(v)]
        if len(variable) != 1:
            raise RewriteSkipped(f"'{node.name}' ({node.op_type}) after the LM head mixes two variable inputs")
        chain.append(node)
        node = variable[0].producer()
    if node is None or node.op_type not in _LM_HEADS:
        found = "a graph input" if node is None else f"'{node.name}' ({node.op_type})"
        raise RewriteSkipped(f"the logits come from {found}, not a MatMul, MatMulNBits or Gemm LM head")
    if len(node.inputs) < 2 or node.inputs[1] is None or not is_constant(node.inputs[1]):
        raise RewriteSkipped(f"LM head '{node.name}' has no constant weight")
    hidden = node.inputs[0]
    if hidden.shape is not None and hidden.shape.rank() != 3:
        raise RewriteSkipped(f"LM head '{node.name}' input has rank {hidden.shape.rank()}, expected 3")
    return node, chain


def rewrite_keep_positions(proto: onnx.ModelProto, logits_name: str, float32_head: bool = False,
                           unpack_qkv: bool = False) -> onnx.ModelProto:
    """Return the graph with the LM head applied only at `ortmodule_logits_indices`. With
    `float32_head`, where the package casts a half-precision MatMul head's logits to float32, the
    head multiplies in float32 instead (its weights cast once, at load): float32 logits that are
    not rounded to half precision first. With `unpack_qkv`, packed projections that a `Split` node
    splits become one MatMul per part (projections.py; ortmodule asks for it on CUDA).

    Raises `RewriteSkipped` when the graph does not match; the input proto is left unchanged.
    """
    model = ir.serde.deserialize_model(proto)
    graph = model.graph
    head, chain = find_lm_head(graph, logits_name)
    indices = ir.Value(name=LOGITS_INDICES, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["num_logits"]))
    graph.inputs.append(indices)
    flatten = ir.node("Flatten", [head.inputs[0]], attributes={"axis": 2}, name="/ortmodule/Flatten")
    gather = ir.node("Gather", [flatten.outputs[0], indices], attributes={"axis": 0}, name="/ortmodule/Gather")
    graph.insert_before(head, [flatten, gather])
    head.replace_input_with(0, gather.outputs[0])
    gather_tail(graph, flatten, gather)  # the tail after the last attention at those positions too, where it can
    # Shapes recorded for [batch, seq, vocab] no longer hold between the head and the output.
    vocab = graph.outputs[[o.name for o in graph.outputs].index(logits_name)].shape
    vocab_dim = vocab[2] if vocab is not None and vocab.rank() == 3 else "vocab_size"
    for node in [head, *chain]:
        for value in node.outputs:  # (a value of no recorded type has no recorded shape)
            value.shape = ir.Shape(["num_logits", vocab_dim]) if value.type is not None else None
    upcast, logits_type = _upcast(head, chain)
    if float32_head:
        if upcast is not None and head.op_type == "MatMul" and len(chain) == 1:
            _multiply_in_float32(graph, head)
            logits_type = ir.DataType.FLOAT
        else:
            logger.info("ortmodule: no float32 LM head for %s: its logits are not a MatMul's half-precision ones "
                        "cast to float32", logits_name)
    if upcast is not None:
        _bypass(graph, upcast, logits_name, logits_type)
    if unpack_qkv:
        unpack_projections(graph)
    return ir.serde.serialize_model(model)


def forget_wrong_shapes(proto: onnx.ModelProto) -> bool:
    """Drop the recorded shapes of the builder's `repeat_kv` values (the outputs of nodes named
    `.../repeat_kv/...`), which hold past + new positions but are declared `sequence_length` long;
    ONNX Runtime infers them instead. Returns whether there were any."""
    wrong = {name for node in proto.graph.node if "/repeat_kv/" in node.name for name in node.output}
    kept = [info for info in proto.graph.value_info if info.name not in wrong]
    if len(kept) == len(proto.graph.value_info):
        return False
    del proto.graph.value_info[:]
    proto.graph.value_info.extend(kept)
    return True


def _load_repaired(decoder_path: Path, cpu: bool = False) -> tuple[onnx.ModelProto, bool]:
    """The decoder graph without its weights, less the shapes `forget_wrong_shapes` drops, with 2-D
    position ids where its rotary nodes take no others (`plain_positions`), a hybrid decoder's layer
    states taken at each row's length (states.py), for a CPU session the contrib ops cpu_forms.py
    writes as standard ones, and whether it changed."""
    proto = onnx.load(str(decoder_path), load_external_data=False)
    repaired = forget_wrong_shapes(proto)
    repaired = unbounded_window_caches(proto) or repaired
    repaired = plain_positions(proto) or repaired
    kinds = {(node.domain, node.op_type) for node in proto.graph.node}
    stateful, decompose = states.has_states(kinds), cpu and cpu_forms.GATED_NORM in kinds
    if not (stateful or decompose):
        return proto, repaired
    model = ir.serde.deserialize_model(proto)
    try:
        states.select_states_at_lengths(model.graph)
    except states.StatesSkipped as reason:
        raise PackageError(f"{decoder_path}: ortmodule cannot run this decoder's layer states: {reason}") from None
    if decompose:
        cpu_forms.decompose(model.graph)
    return ir.serde.serialize_model(model), True


def plain_positions(proto: onnx.ModelProto) -> bool:
    """Declare 3-D position ids 2-D where only rotary nodes that take 2-D ids read them
    (`package.plain_rotary_positions`: the builder's Qwen3.5 export); whether any were."""
    for value in proto.graph.input:
        dims = value.type.tensor_type.shape.dim
        if len(dims) == 3 and plain_rotary_positions(proto.graph, value.name):
            kept = [onnx.TensorShapeProto.Dimension(), onnx.TensorShapeProto.Dimension()]
            kept[0].CopyFrom(dims[1])
            kept[1].CopyFrom(dims[2])
            del dims[:]
            dims.extend(kept)
            return True
    return False


def unbounded_window_caches(proto: onnx.ModelProto) -> bool:
    """Drop GroupQueryAttention's `sliding_window_cache` (builder 0.18's default for sliding-window
    layers: a KV buffer of exactly the window, written as a ring), whether any was set. ortmodule keeps
    every layer's cache as long as its rows (the window is applied by `local_window_size` alone), as
    its caches are selected, cropped and extended column by column; ONNX Runtime's CUDA kernel refuses
    such a buffer with the attribute set ("requires the KV cache capacity to equal local_window_size")."""
    changed = False
    for node in proto.graph.node:
        if node.op_type == "GroupQueryAttention":
            kept = [a for a in node.attribute if a.name != "sliding_window_cache" or a.i == 0]
            if len(kept) != len(node.attribute):
                del node.attribute[:]
                node.attribute.extend(kept)
                changed = True
    return changed


def repaired_graph(decoder_path: Path, cpu: bool = False) -> bytes | None:
    """The package's decoder graph as `_load_repaired` makes it (for a CPU session where `cpu`; the weights
    stay in the package's files), or None where it needs no repair (load the file itself)."""
    proto, repaired = _load_repaired(decoder_path, cpu)
    return proto.SerializeToString() if repaired else None


_HALF = {ir.DataType.FLOAT16, ir.DataType.BFLOAT16}


def _upcast(head: ir.Node, chain: list[ir.Node]) -> tuple[ir.Node | None, ir.DataType | None]:
    """The Cast to float32 of half-precision values that makes the logits output, and their type;
    (None, None) where the output is made otherwise."""
    if not chain or chain[0].op_type != "Cast":
        return None, None
    to, dtype = chain[0].attributes.get("to"), _dtype(chain[0].inputs[0], head, chain[1:])
    if to is None or to.value != ir.DataType.FLOAT or dtype not in _HALF:
        return None, None
    return chain[0], dtype


# The casts `_multiply_in_float32` adds before the head: its hidden states', its weights'.
_FLOAT32_HEAD_CASTS = ("/ortmodule/CastHidden", "/ortmodule/CastWeight")


def has_float32_head(graph_bytes: bytes | None) -> bool:
    """Whether rewritten graph bytes hold the float32 head (`rewrite_keep_positions(..., float32_head=True)`
    applied; the node's name is a plain string in the bytes)."""
    return graph_bytes is not None and _FLOAT32_HEAD_CASTS[1].encode() in graph_bytes


def head_provider_options(provider_options: dict | None, device_type: str, graph_bytes: bytes | None,
                          half_package: bool) -> dict | None:
    """The CUDA provider options for a session of `graph_bytes`: TF32 on (`use_tf32=1`, unless the caller
    set it) where a half-precision package's head was made float32. That head's inputs are half-precision
    values cast to float32, which TF32 holds exactly, so its products are float32's at tensor-core
    speed instead of the CUDA cores' (`runtime.providers` turns TF32 off for fp32 packages, whose
    inputs it would round; a half-precision package has no other float32 MatMul)."""
    if device_type != "cuda" or not half_package or not has_float32_head(graph_bytes) \
            or "use_tf32" in (provider_options or {}):
        return provider_options
    return {**(provider_options or {}), "use_tf32": "1"}


def _multiply_in_float32(graph: ir.Graph, head: ir.Node) -> None:
    """Cast a MatMul head's inputs to float32 (ONNX Runtime folds the weights' cast at load, into a
    float32 copy of them), so that its products are summed and returned in float32."""
    casts = [ir.node("Cast", [value], attributes={"to": ir.AttrInt64("to", ir.DataType.FLOAT)},
                     name=name) for value, name in zip(head.inputs, _FLOAT32_HEAD_CASTS)]
    graph.insert_before(head, casts)
    for i, cast in enumerate(casts):
        head.replace_input_with(i, cast.outputs[0])
    head.outputs[0].dtype = ir.DataType.FLOAT


def _bypass(graph: ir.Graph, cast: ir.Node, logits_name: str, dtype: ir.DataType) -> None:
    """Make the input of `cast` (the logits output's producer) the output, named as it was, and
    remove the Cast: half-precision logits in half the bytes, or a float32 head's without a copy."""
    source, output = cast.inputs[0], cast.outputs[0]
    place = list(graph.outputs).index(output)
    output.name = f"{logits_name}/ortmodule_cast"
    graph.outputs[place] = source
    graph.remove(cast, safe=True)
    source.name = logits_name
    source.dtype = dtype


def _dtype(value: ir.Value, head: ir.Node, between: list[ir.Node]) -> ir.DataType | None:
    """The element type of `value`, the output of `between[0]` (or of `head` when `between` is
    empty): as recorded, else that of the head's weights (MatMulNBits: its scales) when no Cast
    lies between."""
    if value.dtype is not None:
        return value.dtype
    if any(node.op_type == "Cast" for node in between):
        return None
    weights = head.inputs[2 if head.op_type == "MatMulNBits" else 1]
    if weights is None:
        return None
    if weights.dtype is not None:
        return weights.dtype
    return weights.const_value.dtype if weights.const_value is not None else None


# A cache entry is the rewritten graph followed by this marker and the SHA-256 of the graph bytes,
# so a reader checks what it read in one file (a torn, truncated or foreign file fails the check).
_TRAILER = b"\nORTMODULE-SHA256:"
_DIGEST = 64


@functools.cache
def code_digest() -> str:
    """A digest of the rewrites' source files (`_REWRITE_SOURCES`), a part of every cache key: an
    entry made by other rewrite code (an upgrade, a change that did not bump REWRITE_VERSION) is
    made again instead of reused. Where the files cannot be read, the version alone."""
    digest = hashlib.sha256(REWRITE_VERSION.encode())
    try:
        for name in _REWRITE_SOURCES:
            digest.update(Path(__file__).with_name(name).read_bytes())
    except OSError:
        return REWRITE_VERSION
    return digest.hexdigest()[:16]


def file_digest(path: Path) -> str:
    """sha256 of a file's content (read every time: a file replaced with the same size and time is
    another file; a decoder graph without its weights is a few hundred KB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _cache_key(path: Path, logits_name: str, float32_head: bool = False, unpack_qkv: bool = False,
               cpu: bool = False) -> str:
    """The source graph's content (not its path: a replaced file gets its own entry; `file_digest`),
    the logits name, the rewrite's options, its version and its code."""
    digest = hashlib.sha256(file_digest(path).encode())
    digest.update(f"|{logits_name}|{REWRITE_VERSION}|{code_digest()}|{ir.__version__}"
                  f"{'|float32_head' * float32_head}{'|unpack_qkv' * unpack_qkv}{'|cpu' * cpu}".encode())
    return digest.hexdigest()[:32]


def _read_entry(entry: Path) -> bytes | None:
    """The graph bytes of a cache entry, or None (with a warning) when it fails its check."""
    try:
        data = entry.read_bytes()
    except OSError as e:
        logger.warning("ortmodule: cannot read the rewrite cache entry %s (%s); rebuilding it", entry, e)
        return None
    framed, digest = data[:-_DIGEST], data[-_DIGEST:]
    body = framed[: -len(_TRAILER)]
    intact = framed.endswith(_TRAILER) and hashlib.sha256(body).hexdigest().encode() == digest
    if not intact or LOGITS_INDICES.encode() not in body:
        logger.warning("ortmodule: the rewrite cache entry %s is damaged or not ortmodule's; rebuilding it", entry)
        return None
    return body


def _write_entry(entry: Path, data: bytes) -> None:
    """Write a cache entry atomically (a temporary file renamed into place; removed on failure)."""
    partial = entry.with_name(f".{entry.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with open(partial, "wb") as f:
            f.write(data + _TRAILER + hashlib.sha256(data).hexdigest().encode())
        partial.replace(entry)
    except OSError as e:  # a read-only or full cache costs a rewrite per load, nothing else
        with contextlib.suppress(OSError):  # nothing to remove where the folder could not be made
            partial.unlink(missing_ok=True)
        _warn_once(entry.parent, e)


_warned: set[Path] = set()


def _warn_once(folder: Path, error: OSError) -> None:
    if folder not in _warned:
        _warned.add(folder)
        logger.warning("ortmodule: cannot write the rewrite cache in %s (%s); rewriting at every load instead", folder,
                       error)


def checked_rewrite(rewrite):
    """A caller's `rewrite_lm_head`: True, False or "float32", else a ValueError naming it."""
    if rewrite not in (True, False, "float32"):
        raise ValueError(f"rewrite_lm_head must be True, False or 'float32', got {rewrite!r}")
    return rewrite


def lm_head_graph(decoder_path: Path, logits_name: str, rewrite, cache_dir: Path | None = None,
                  unpack_qkv: bool = False, cpu: bool = False) -> bytes | None:
    """`keep_positions_graph` as `rewrite_lm_head` asks: True, "float32" (a float32 head where it
    applies), or False (None: the package's graph as it is)."""
    if not checked_rewrite(rewrite):
        return None
    return keep_positions_graph(decoder_path, logits_name, cache_dir, rewrite == "float32", unpack_qkv, cpu)


def keep_positions_graph(decoder_path: Path, logits_name: str, cache_dir: Path | None = None,
                         float32_head: bool = False, unpack_qkv: bool = False, cpu: bool = False) -> bytes | None:
    """Bytes of the rewritten decoder graph (weights stay in the package's files; for a CPU session where
    `cpu`, `_load_repaired`), or None with a logged reason when the graph does not match. Built once per
    source graph content, then read from the cache; an entry that fails its check is rebuilt with a warning."""
    def build() -> bytes:
        return rewrite_keep_positions(_load_repaired(decoder_path, cpu)[0], logits_name, float32_head,
                                      unpack_qkv).SerializeToString()

    key = _cache_key(decoder_path, logits_name, float32_head, unpack_qkv, cpu)
    try:
        return cached(cache_dir, f"{decoder_path.stem}-{key}", build)
    except RewriteSkipped as reason:
        logger.warning("ortmodule: computing logits for every position of %s: %s", decoder_path, reason)
        return None


def cached(cache_dir: Path | None, name: str, build) -> bytes:
    """Graph bytes from the cache entry `name`, or `build()` them and write the entry (exceptions
    from `build` pass through, nothing written)."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    entry = cache_dir / f"{name}.onnx"
    if entry.is_file():
        data = _read_entry(entry)
        if data is not None:
            cache_folder.touch(entry)  # its last use, for `ortmodule cache clear --older-than`
            return data
    data = build()
    _write_entry(entry, data)
    return data
