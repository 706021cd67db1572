"""Constant values of an onnx-ir graph, as the rewrites (graph.py, projections.py, tail.py) read them."""

from __future__ import annotations

from pathlib import Path

import onnx_ir as ir


def constant_tensor(value: ir.Value | None) -> ir.TensorProtocol | None:
    """The tensor of a constant value (an initializer's, a Constant node's `value`), else None."""
    if value is None:
        return None
    if value.const_value is not None:
        return value.const_value
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant" and "value" in producer.attributes:
        return producer.attributes["value"].value
    return None


def readable(tensor: ir.TensorProtocol) -> ir.TensorProtocol:
    """`tensor`, to read its values: an external tensor whose file is a link out of its graph's folder (a
    package in the Hugging Face Hub's cache, whose files link to its blobs) as the same bytes at the file
    linked to, which onnx-ir reads (it refuses a link out of the folder: "may indicate a path traversal
    attack via a symbolic link"). Other tensors as they are."""
    if not isinstance(tensor, ir.ExternalTensor):
        return tensor
    path = Path(tensor.base_dir) / tensor.location
    target = path.resolve()
    if target == path.absolute():
        return tensor
    return ir.ExternalTensor(target.name, tensor.offset, tensor.length, tensor.dtype, shape=tensor.shape,
                             name=tensor.name, base_dir=target.parent)


def is_constant(value: ir.Value) -> bool:
    """Whether `value` is an initializer or a Constant node's output (its data may be external)."""
    if value.const_value is not None or value.is_initializer():
        return True
    producer = value.producer()
    return producer is not None and producer.op_type == "Constant"
