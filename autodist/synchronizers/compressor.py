"""Compressors: what an all-reduced gradient looks like on the wire.

One class per value of the ``AllReduceSynchronizer.Compressor`` enum. A class
owns everything about its kind: the graph work (``compress(tensor) -> (tensor,
ctx)`` and ``decompress(tensor, ctx)``, one instance per collective and
replica), the bytes it puts on the wire, and whether it is lossy. The cost
model, the simulator's features and the sampler ask the class, never the enum
number. Sparse gradients are gathered as they are, whatever the compressor.

TensorFlow is imported by the graph work alone: the cost model and the sampler
read the classes' facts and load without it.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, ClassVar, Dict, List, Optional, Type

import numpy as np

if TYPE_CHECKING:  # for the annotations only
    import tensorflow as tf

from autodist.proto import synchronizers_pb2

_ENUM = synchronizers_pb2.AllReduceSynchronizer.Compressor


class Compressor:
    """A compressor kind; subclasses set the class attributes and the graph work.

    Attributes:
        enum_name: its name in the proto enum, which selects it.
        lossy: the mean the replicas receive may differ from the exact one.
        error_feedback: it keeps the rounding error and adds it to the next gradient.
        wire_dtype: floating dense gradients travel as this numpy dtype; None: as they are.
    """

    enum_name: ClassVar[str]
    lossy: ClassVar[bool] = False
    error_feedback: ClassVar[bool] = False
    wire_dtype: ClassVar[Optional[str]] = None

    def __init__(self, var_scope: str):
        """``var_scope`` names any state the compressor keeps (error feedback)."""
        self._scope = var_scope

    @classmethod
    def wire_bytes(cls, grad_bytes: float, dtype: str, sparse: bool) -> float:
        """Bytes one replica's gradient of ``grad_bytes`` puts on the wire."""
        return grad_bytes * _wire_ratio(cls.wire_dtype, dtype, sparse)

    def compress(self, tensor: "tf.Tensor") -> tuple:
        """(what goes on the wire, what :meth:`decompress` needs back)."""
        return tensor, None

    def decompress(self, tensor: "tf.Tensor", ctx) -> "tf.Tensor":
        del ctx
        return tensor


@functools.lru_cache(maxsize=None)
def _wire_ratio(wire_dtype: Optional[str], dtype: str, sparse: bool) -> float:
    if wire_dtype is None or sparse or not np.issubdtype(np.dtype(dtype), np.floating):
        return 1.0
    return np.dtype(wire_dtype).itemsize / np.dtype(dtype).itemsize


class NoneCompressor(Compressor):
    """Sends the gradient as it is."""

    enum_name = "NoneCompressor"


class FP16Compressor(Compressor):
    """Sends floating-point gradients as float16, halving the bytes on the wire."""

    enum_name = "HorovodCompressor"
    lossy = True
    wire_dtype = "float16"

    def compress(self, tensor: "tf.Tensor") -> tuple:
        import tensorflow as tf
        if not tensor.dtype.is_floating:
            return tensor, None
        return tf.cast(tensor, tf.float16), tensor.dtype

    def decompress(self, tensor: "tf.Tensor", ctx) -> "tf.Tensor":
        import tensorflow as tf
        return tensor if ctx is None else tf.cast(tensor, ctx)


class FP16ErrorFeedbackCompressor(FP16Compressor):
    """float16 on the wire; the rounding error is kept and added to the next gradient."""

    enum_name = "HorovodCompressorEF"
    error_feedback = True

    def compress(self, tensor: "tf.Tensor") -> tuple:
        import tensorflow as tf
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


def _registry(classes: List[Type[Compressor]]) -> Dict[int, Type[Compressor]]:
    """Enum value -> class; fails at import when an enum value has no class, or a class no value."""
    by_name = {cls.enum_name: cls for cls in classes}
    unknown = sorted(set(by_name) - set(_ENUM.keys()))
    missing = sorted(set(_ENUM.keys()) - set(by_name))
    if unknown or missing:
        raise ImportError(f"Compressor registry out of step with the proto: enum values without "
                          f"a class {missing}, classes without an enum value {unknown}.")
    return {_ENUM.Value(name): cls for name, cls in by_name.items()}


COMPRESSORS = _registry([NoneCompressor, FP16Compressor, FP16ErrorFeedbackCompressor])
"""``AllReduceSynchronizer.Compressor`` value -> its class."""

LOSSY = tuple(cls.enum_name for cls in COMPRESSORS.values() if cls.lossy)
"""Names of the lossy compressors, which a search may only choose when allowed to."""


def compressor_class(value: int) -> Type[Compressor]:
    """The class of an ``AllReduceSynchronizer.compressor`` value.

    Raises:
        ValueError: for a value the enum does not define, listing the valid ones.
    """
    if value not in COMPRESSORS:
        raise ValueError(f"Unknown compressor {value}; valid ones are "
                         f"{ {cls.enum_name: v for v, cls in COMPRESSORS.items()} }.")
    return COMPRESSORS[value]
