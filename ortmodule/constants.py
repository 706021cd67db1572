"""Constant values of an onnx-ir graph, as the rewrites (graph.py, projections.py, tail.py) read them."""

from __future__ import annotations

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


def is_constant(value: ir.Value) -> bool:
    """Whether `value` is an initializer or a Constant node's output (its data may be external)."""
    if value.const_value is not None or value.is_initializer():
        return True
    producer = value.producer()
    return producer is not None and producer.op_type == "Constant"
