"""Compressors: what an all-reduced gradient looks like on the wire.

Each is a two-method interface, ``compress(tensor) -> (tensor, ctx)`` and
``decompress(tensor, ctx) -> tensor``, registered under its proto enum name.
"""
from __future__ import annotations

import tensorflow as tf

from autodist.proto import synchronizers_pb2

_REGISTRY = {}


def register(name: str):
    """Class decorator adding a compressor under ``name`` (its proto enum name)."""
    def add(cls):
        _REGISTRY[name] = cls
        return cls
    return add


def compressor_name(value: int) -> str:
    """The proto enum name of an ``AllReduceSynchronizer.compressor`` value, its registry key.

    Raises:
        ValueError: for a value the enum does not define.
    """
    return synchronizers_pb2.AllReduceSynchronizer.Compressor.Name(value)


def make_compressor(name: str, var_scope: str):
    """A new compressor of kind ``name`` for one collective of one replica.

    Args:
        name: proto enum name, e.g. ``"HorovodCompressor"``.
        var_scope: name for any state the compressor keeps (error feedback).

    Raises:
        ValueError: for an unknown name, listing the known ones.
    """
    if name not in _REGISTRY:
        raise ValueError(f"Unknown compressor '{name}'; valid ones are {sorted(_REGISTRY)}.")
    return _REGISTRY[name](var_scope)


@register("NoneCompressor")
class NoneCompressor:
    """Sends the gradient as it is."""

    def __init__(self, var_scope: str):
        del var_scope

    def compress(self, tensor: tf.Tensor):
        return tensor, None

    def decompress(self, tensor: tf.Tensor, ctx) -> tf.Tensor:
        del ctx
        return tensor


@register("HorovodCompressor")
class FP16Compressor:
    """Sends floating-point gradients as float16, halving the bytes on the wire."""

    def __init__(self, var_scope: str):
        del var_scope

    def compress(self, tensor: tf.Tensor):
        if not tensor.dtype.is_floating:
            return tensor, None
        return tf.cast(tensor, tf.float16), tensor.dtype

    def decompress(self, tensor: tf.Tensor, ctx) -> tf.Tensor:
        return tensor if ctx is None else tf.cast(tensor, ctx)


@register("HorovodCompressorEF")
class FP16ErrorFeedbackCompressor(FP16Compressor):
    """float16 on the wire; the rounding error is kept and added to the next gradient."""

    def __init__(self, var_scope: str):
        super().__init__(var_scope)
        self._scope = var_scope

    def compress(self, tensor: tf.Tensor):
        if not tensor.dtype.is_floating:
            return tensor, None
        # A static shape: the initial value must not depend on the step's inputs.
        error = tf.Variable(tf.zeros(tensor.shape, tensor.dtype), trainable=False,
                            name=f"{self._scope}/compression_error")
        corrected = tensor + error
        compressed = tf.cast(corrected, tf.float16)
        remember = error.assign(corrected - tf.cast(compressed, tensor.dtype))
        with tf.control_dependencies([remember]):
            compressed = tf.identity(compressed)
        return compressed, tensor.dtype
