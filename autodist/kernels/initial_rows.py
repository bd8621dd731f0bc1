"""Some rows of a variable's initial value, computed without computing the rest.

A table partitioned by rows gets each part's initial value on the part's own
device; cutting the whole value there would first build the whole table on one
device (the chief's), which a table larger than one node cannot afford. That
is possible when the value comes from ops that produce any range of rows on
their own:

* ``Fill`` (``tf.zeros``, ``tf.ones`` and other constant fills of large shapes)
  and ``Const`` (small ones; its rows are copied);
* TensorFlow's Philox random ops: the stateless ``StatelessRandomUniformV2`` /
  ``StatelessRandomNormalV2`` (Keras 3's initializers, ``tf.random.stateless_*``)
  and the seeded stateful ``RandomUniform`` / ``RandomStandardNormal``
  (``tf.compat.v1`` initializers with a seed);
* element-wise ops over those (``Mul``, ``AddV2``, ``Cast`` ...) whose other
  operand is the same for every row (a scalar, a row vector): how the
  initializers scale and shift their samples.

The random ops draw from a counter-based generator: TensorFlow's CPU kernels
(the only ones tested here) give sample ``i`` of a float32 output (two per step for float64) the
counter ``initial counter + i // 4``, so rows ``[begin, end)`` are the same op
with its counter advanced by ``begin * row_size / 4`` (a whole number of
steps is required). A seeded stateful op's generator is ``key = seed``,
``counter = (0, seed2)`` as a 128-bit number, at its first run, which is when
an initializer runs. Tests compare every case with the rows cut from the whole
value, so a TensorFlow that changes its generators fails them.

Other values (a ``TruncatedNormal``, a matmul, a value read from a file) are
not handled here: their parts are cut from the whole value.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import numpy as np
import tensorflow as tf

Rows = Callable[[], tf.Tensor]

_STATELESS = ("StatelessRandomUniformV2", "StatelessRandomNormalV2")
_STATEFUL = {"RandomUniform": "StatelessRandomUniformV2",
             "RandomStandardNormal": "StatelessRandomNormalV2"}
_PHILOX, _AUTO_SELECT = 1, 3  # tf.random.Algorithm values; CPUs and GPUs auto-select Philox
# Samples per step of the generator's counter: one 32-bit draw per float32, two per float64.
_SAMPLES_PER_STEP = {tf.float32: 4, tf.float64: 2}
_UNARY = ("Identity", "Cast", "Neg")
_BINARY = ("Mul", "AddV2", "Add", "Sub", "RealDiv", "Maximum", "Minimum")


def rows_of(value: tf.Tensor, begin: int, end: int) -> Optional[Rows]:
    """A function building ``value[begin:end]`` (axis 0) in the current graph and device
    scope without ``value``'s other rows, or None where ``value``'s ops do not allow it.

    Nothing is built until the function is called.
    """
    shape = value.shape
    if shape.rank is None or shape.rank == 0 or not shape.is_fully_defined():
        return None
    if not 0 <= begin < end <= shape[0]:
        return None
    op = value.op
    rows = end - begin
    if op.type == "Const":  # small: tf.zeros of fewer than 1000 elements is one
        rows_value = tf.make_ndarray(op.get_attr("value"))[begin:end]
        return lambda: tf.constant(rows_value)
    if op.type == "Fill":
        fill = op.inputs[1]
        return lambda: tf.fill([rows] + shape[1:].as_list(), fill)
    if op.type in _UNARY:
        inner = rows_of(op.inputs[0], begin, end)
        if inner is None:
            return None
        if op.type == "Cast":
            return lambda: tf.cast(inner(), value.dtype)
        return inner if op.type == "Identity" else lambda: tf.negative(inner())
    if op.type in _BINARY:
        return _binary_rows(op, value, begin, end)
    if op.type in _STATELESS:
        return _stateless_rows(op, value, begin, end)
    if op.type in _STATEFUL:
        return _stateful_rows(op, value, begin, end)
    return None


def _binary_rows(op: tf.Operation, value: tf.Tensor, begin: int, end: int) -> Optional[Rows]:
    operands = []
    for operand in op.inputs:
        if _same_for_every_row(operand, value):
            operands.append(lambda t=operand: t)
        elif operand.shape == value.shape:
            rows = rows_of(operand, begin, end)
            if rows is None:
                return None
            operands.append(rows)
        else:
            return None
    build = getattr(tf.raw_ops, op.type)
    return lambda: build(x=operands[0](), y=operands[1]())


def _same_for_every_row(operand: tf.Tensor, value: tf.Tensor) -> bool:
    """Whether ``operand`` broadcasts along ``value``'s rows (a scalar, a row vector)."""
    shape = operand.shape
    if shape.rank is None or not shape.is_fully_defined():
        return False
    return shape.rank < value.shape.rank or shape[0] == 1 and value.shape[0] != 1


def _counter_offset(value: tf.Tensor, begin: int) -> Optional[int]:
    """Counter steps before sample ``begin * row size``, if a whole number."""
    per_step = _SAMPLES_PER_STEP.get(value.dtype)
    if per_step is None:
        return None
    first = begin * math.prod(value.shape[1:].as_list())
    return first // per_step if first % per_step == 0 else None


def _stateless_rows(op: tf.Operation, value: tf.Tensor, begin: int, end: int) -> Optional[Rows]:
    key, counter, alg = op.inputs[1], op.inputs[2], op.inputs[3]
    if tf.get_static_value(alg) not in (_PHILOX, _AUTO_SELECT):
        return None
    offset = _counter_offset(value, begin)
    if offset is None:
        return None
    build = getattr(tf.raw_ops, op.type)
    shape = [end - begin] + value.shape[1:].as_list()
    return lambda: build(shape=shape, key=key, counter=_advanced(counter, offset), alg=alg,
                         dtype=value.dtype)


def _stateful_rows(op: tf.Operation, value: tf.Tensor, begin: int, end: int) -> Optional[Rows]:
    seed, seed2 = op.get_attr("seed"), op.get_attr("seed2")
    if not seed and not seed2:  # unseeded: TensorFlow draws the seeds at run time
        return None
    offset = _counter_offset(value, begin)
    if offset is None:
        return None
    build = getattr(tf.raw_ops, _STATEFUL[op.type])
    shape = [end - begin] + value.shape[1:].as_list()
    return lambda: build(shape=shape, key=tf.constant([_uint64(seed)], tf.uint64),
                         counter=tf.constant([_uint64(offset), _uint64(seed2)], tf.uint64),
                         alg=_PHILOX, dtype=value.dtype)


def _uint64(number: int) -> np.uint64:
    """An int64 attribute's bits as the uint64 the generator takes."""
    return np.uint64(number & 0xFFFFFFFFFFFFFFFF)


def _advanced(counter: tf.Tensor, steps: int) -> tf.Tensor:
    """A Philox counter (two uint64 words, low first) advanced by ``steps``."""
    if not steps:
        return counter
    low = counter[0] + tf.constant(steps, tf.uint64)
    carry = tf.cast(low < counter[0], tf.uint64)
    return tf.stack([low, counter[1] + carry])
