"""The ranking simulator's parts: input normalization and the Keras scoring network.

:class:`RankingSimulator` (``ranking.py``) puts them together and explains the
prior and the loss; this is the network's design.

A dense layer encodes every variable and two branches read the encodings.

* Recurrent: consecutive variables are pooled into at most ``max_steps`` blocks
  (``stride`` variables each), so the GRU runs a few dozen steps even for a
  thousand-part strategy, which keeps training to seconds. It reads the blocks
  in graph order (an AllReduce group or the layers of one block sit together);
  its last state and mean output go to a linear head.
* Pooled: the encodings summed over all variables (padding masked out) go to a
  dense head. Most communication cost is a sum (bytes per server, collectives
  per group), which a bounded recurrent state carries poorly over hundreds of
  steps.

The correction is the sum of both heads, both starting at zero. The recurrent
branch gets ten times the L2 penalty: on a few dozen trials it overfits (30
trials of synthetic data like that of ``tests/test_ranking.py``, three data
sets: mean held-out Kendall tau 0.79 with the tenfold penalty, 0.65 with equal
ones, 0.78 with no recurrent branch at all), and it can still earn its weight
where order carries signal and trials are many.

Inputs are normalized (``log1p`` on byte-like columns, then standardization,
plus a linear copy of the byte columns so that sums add up bytes, see
:class:`Normalization`) with statistics fitted on training data and saved with
the weights.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import keras
import numpy as np
import tensorflow as tf

__all__ = ["Normalization", "ScoreNet"]

_LOG_COLUMN_MIN = 1024.0  # a never-negative column reaching this is taken for a byte count
_MIN_STD = 1e-6


@dataclasses.dataclass(frozen=True)
class Normalization:
    """Per-feature input scaling and the pooling stride, fitted on training data.

    Attributes:
        log_columns: columns put through ``log1p`` first.
        mean: per-column mean after the log, shape ``[num_features]``.
        std: per-column standard deviation after the log (1 for constant columns).
        linear_scale: per-column divisor of the linear copy of the log
            columns (their mean absolute value; 1 elsewhere).
        stride: variables pooled into one GRU step.
        sum_scale: divisor of the summed per-variable encodings (the mean
            sequence length), so the sum stays near unit scale.

    The network sees every column normalized and, beside it, a linear copy of
    each log column divided by its mean (zero for other columns): after the
    log, a sum of encodings over variables no longer adds up bytes, yet most
    communication cost is a sum of bytes, dominated by the largest variables.
    """

    log_columns: Tuple[int, ...]
    mean: np.ndarray
    std: np.ndarray
    linear_scale: np.ndarray
    stride: int
    sum_scale: float

    @classmethod
    def fit(cls, sequences: Sequence[np.ndarray], log_columns: Optional[Tuple[int, ...]],
            max_steps: int) -> "Normalization":
        """Statistics of ``sequences`` (non-empty, 2-D, finite; checked by the caller).

        Args:
            sequences: feature arrays ``[num_variables, num_features]``.
            log_columns: columns to ``log1p``; None to detect byte-like ones.
            max_steps: the longest sequence is pooled into at most this many steps.

        Returns:
            Normalization: the fitted statistics.
        """
        rows = np.concatenate(list(sequences), axis=0)
        if log_columns is None:
            log_columns = tuple(int(c) for c in np.flatnonzero(
                (rows.min(axis=0) >= 0) & (rows.max(axis=0) >= _LOG_COLUMN_MIN)))
        linear_scale = np.abs(rows).mean(axis=0)
        linear_scale[linear_scale < _MIN_STD] = 1.0
        rows = _log_columns(rows, log_columns)
        std = rows.std(axis=0)
        std[std < _MIN_STD] = 1.0
        lengths = [len(seq) for seq in sequences]
        return cls(log_columns=tuple(log_columns), mean=rows.mean(axis=0), std=std,
                   linear_scale=linear_scale, stride=max(1, math.ceil(max(lengths) / max_steps)),
                   sum_scale=float(np.mean(lengths)))

    def apply(self, sequence: np.ndarray) -> np.ndarray:
        """The network's input for one feature array.

        Returns:
            np.ndarray: float32 ``[num_variables, 2 * num_features]``, the
            normalized columns, then the linear copies (zero for other columns).
        """
        out = np.zeros((len(sequence), 2 * len(self.mean)), np.float32)
        out[:, :len(self.mean)] = (_log_columns(sequence, self.log_columns) - self.mean) / self.std
        cols = list(self.log_columns)
        out[:, [len(self.mean) + c for c in cols]] = sequence[:, cols] / self.linear_scale[cols]
        return out

    def to_json(self) -> Dict[str, Any]:
        """The scalar fields, for the saved state (the arrays are saved beside them)."""
        return {"log_columns": list(self.log_columns), "stride": self.stride,
                "sum_scale": self.sum_scale}

    def arrays(self) -> Dict[str, np.ndarray]:
        """The array fields, for the saved state."""
        return {"mean": self.mean, "std": self.std, "linear_scale": self.linear_scale}

    @classmethod
    def from_json(cls, fields: Dict[str, Any], arrays: Dict[str, np.ndarray],
                  num_features: int) -> "Normalization":
        """The inverse of :meth:`to_json` and :meth:`arrays`.

        Raises:
            ValueError: an array does not hold ``num_features`` finite values
                (positive for the scales), or a field is out of range.
        """
        mean, std, scale = (np.asarray(arrays[k], np.float64)
                            for k in ("mean", "std", "linear_scale"))
        for name, array in (("mean", mean), ("std", std), ("linear_scale", scale)):
            if array.shape != (num_features,) or not np.all(np.isfinite(array)):
                raise ValueError(f"normalization {name} has shape {array.shape} or non-finite "
                                 f"values; expected {num_features} finite values")
        if not (np.all(std > 0) and np.all(scale > 0)):
            raise ValueError("normalization std or linear_scale holds a value <= 0")
        stride, sum_scale = int(fields["stride"]), float(fields["sum_scale"])
        if stride < 1 or not sum_scale > 0:
            raise ValueError(f"stride {stride} or sum_scale {sum_scale} out of range")
        columns = tuple(int(c) for c in fields["log_columns"])
        if any(not 0 <= c < num_features for c in columns):
            raise ValueError(f"log_columns {columns} out of range")
        return cls(columns, mean, std, scale, stride, sum_scale)


def _log_columns(rows: np.ndarray, columns: Sequence[int]) -> np.ndarray:
    out = np.array(rows, dtype=np.float64)
    if columns:
        cols = list(columns)
        # Signed, so that a negative value in a column chosen by hand stays finite.
        out[:, cols] = np.sign(out[:, cols]) * np.log1p(np.abs(out[:, cols]))
    return out


class ScoreNet(keras.Model):
    """Log-score of padded feature batches: prior term plus a learned correction.

    ``call(features [B, T, 2F], mask [B, T] bool, log_prior [B], stride, sum_scale,
    correction_scale)`` returns ``[B]``, with ``T`` a multiple of ``stride`` and
    ``features`` from :meth:`Normalization.apply`. A dense encoder feeds two
    branches: a GRU over blocks of ``stride`` variables (mean-pooled per block)
    whose last state and mean output go to a linear head, and the masked sum of
    the encodings, divided by ``sum_scale``, through a dense head. The heads'
    sum, times ``correction_scale``, is the correction. Both heads start at
    zero, so an untrained net returns ``offset + prior_weight * log_prior``.

    Args:
        units: width of the encoder, GRU and head.
        use_prior: whether ``prior_weight`` starts at 1 and trains (else it is 0, frozen).
        seed: seed of every initializer.
    """

    def __init__(self, units: int, use_prior: bool, seed: int):
        super().__init__(name="ranking_score_net")
        self.units = units

        def glorot(k: int) -> keras.initializers.Initializer:
            return keras.initializers.GlorotUniform(seed=seed * 101 + k)

        # Explicit names: automatic ones draw on Keras' per-thread layer counter,
        # which user models built later in this thread would see advanced.
        self.encoder = keras.layers.Dense(units, activation="relu", name="encoder",
                                          kernel_initializer=glorot(0))
        self.rnn = keras.layers.GRU(units, return_sequences=True, return_state=True, name="gru",
                                    kernel_initializer=glorot(1),
                                    recurrent_initializer=keras.initializers.Orthogonal(
                                        seed=seed * 101 + 2))
        self.hidden = keras.layers.Dense(units, activation="relu", name="hidden",
                                         kernel_initializer=glorot(3))
        self.head = keras.layers.Dense(1, kernel_initializer="zeros", name="head")
        self.rnn_head = keras.layers.Dense(1, kernel_initializer="zeros", name="rnn_head")
        self.prior_weight = self.add_weight(
            name="prior_weight", shape=(), trainable=use_prior,
            initializer=keras.initializers.Constant(1.0 if use_prior else 0.0))
        self.offset = self.add_weight(name="offset", shape=(), initializer="zeros")

    def kernels(self) -> Tuple[List[tf.Variable], List[tf.Variable]]:
        """The weight matrices under L2 (not biases, offset, prior weight).

        Returns:
            tuple: the pooled branch's kernels, and the recurrent branch's.
        """
        rnn = [w for w in self.rnn.trainable_weights if "bias" not in w.path]
        return ([self.encoder.kernel, self.hidden.kernel, self.head.kernel],
                rnn + [self.rnn_head.kernel])

    def call(self, features, mask, log_prior, stride, sum_scale, correction_scale):
        """See the class docstring."""
        valid = tf.cast(mask, features.dtype)[..., None]
        encoded = self.encoder(features) * valid  # padding contributes nothing
        batch, length = tf.shape(encoded)[0], tf.shape(encoded)[1]
        blocks = tf.reshape(encoded, [batch, length // stride, stride, self.units])
        blocks = tf.reduce_sum(blocks, axis=2) / tf.cast(stride, features.dtype)
        block_mask = tf.reduce_any(tf.reshape(mask, [batch, length // stride, stride]), axis=2)
        outputs, last = self.rnn(blocks, mask=block_mask)
        block_valid = tf.cast(block_mask, features.dtype)[..., None]
        mean_output = (tf.reduce_sum(outputs * block_valid, axis=1)
                       / tf.maximum(tf.reduce_sum(block_valid, axis=1), 1.0))
        total = tf.reduce_sum(encoded, axis=1) / sum_scale
        correction = (self.head(self.hidden(total))[:, 0]
                      + self.rnn_head(tf.concat([last, mean_output], axis=-1))[:, 0])
        return self.offset + self.prior_weight * log_prior + correction_scale * correction
