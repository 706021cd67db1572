"""Weight files that are links: a package in the Hugging Face hub's cache (`snapshot_download`,
`huggingface-cli download` without `--local-dir`) holds `model.onnx.data` as a link to
`../../blobs/<sha256>`. ONNX Runtime (1.24 and later) refuses external weights whose real path lies
outside the folder it reads them from. A graph loaded from its file passes (ONNX Runtime also looks
beside the file's real path), but a graph ortmodule rewrote is loaded from bytes, whose only folder
is the package's: every such session failed with "External data path escapes model directory".

`relocated` points such bytes at the weights' real folder and names (no copy of the weights); a
package whose files are not links is left as it is, unparsed.
"""

from __future__ import annotations

import os
from pathlib import Path

import onnx

from .package import PackageError


def relocated(model: bytes, folder: Path) -> tuple[bytes, Path]:
    """`model` (graph bytes whose external weights live in `folder`) and the folder ONNX Runtime
    reads them from, with each weight file's links followed. A PackageError where the linked files
    lie in more than one folder (no one folder holds them all)."""
    folder = Path(folder)
    try:
        linked = any(entry.is_symlink() for entry in os.scandir(folder))
    except OSError:
        return model, folder
    if not linked:
        return model, folder
    proto = onnx.load_from_string(model)
    tensors = [t for t in _tensors(proto.graph) if t.data_location == onnx.TensorProto.EXTERNAL]
    real = {}
    for tensor in tensors:
        location = _entry(tensor, "location")
        if location is not None and location not in real:
            real[location] = (folder / location).resolve()
    if not real or all(path.parent == folder.resolve() for path in real.values()):
        return model, folder
    parents = {path.parent for path in real.values()}
    if len(parents) > 1:
        raise PackageError(f"{folder}: the decoder's weight files are links into several folders "
                           f"({', '.join(sorted(map(str, parents)))}), which ONNX Runtime cannot read from one graph "
                           "that ortmodule rewrote: copy the package into a folder of its own (huggingface-cli "
                           "download --local-dir DIR)")
    for tensor in tensors:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = real[entry.value].name
    return proto.SerializeToString(), parents.pop()


def _entry(tensor: onnx.TensorProto, key: str) -> str | None:
    return next((entry.value for entry in tensor.external_data if entry.key == key), None)


def _tensors(graph: onnx.GraphProto):
    """Every tensor of `graph` and its subgraphs: initializers and nodes' tensor attributes."""
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            if attribute.HasField("g"):
                yield from _tensors(attribute.g)
            for subgraph in attribute.graphs:
                yield from _tensors(subgraph)
