"""Small Keras 3 models and their data, for the Keras front end's tests.

``build(name)`` seeds Keras's global generators before creating the layers,
so two builds start from identical weights (and identical dropout seeds).
Models and layers carry explicit names, so two builds also name their
variables alike: a strategy saved for one build applies to the next.
Every data set has ``SAMPLES`` rows, a multiple of ``BATCH_SIZE``, which two
and four replicas split evenly.
"""
from __future__ import annotations

from typing import Callable, Dict, Tuple

import keras
import numpy as np
import tensorflow as tf

SAMPLES = 32
BATCH_SIZE = 8
VOCABULARY = 50
TOKENS = 20


def _mlp() -> keras.Model:
    return keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(8, activation="relu", name="hidden"),
        keras.layers.Dense(3, name="out"),
    ], name="mlp")


def _embedding() -> keras.Model:
    return keras.Sequential([
        keras.Input((4,), dtype="int32"),
        keras.layers.Embedding(VOCABULARY, 6, name="table"),
        keras.layers.Flatten(name="flat"),
        keras.layers.Dense(1, name="out"),
    ], name="embedding")


def _cnn() -> keras.Model:
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(4, 3, activation="relu", name="conv"),
        keras.layers.MaxPooling2D(2, name="pool"),
        keras.layers.Flatten(name="flat"),
        keras.layers.Dense(3, name="out"),
    ], name="cnn")


def _transformer() -> keras.Model:
    ids = keras.Input((6,), dtype="int32")
    hidden = keras.layers.Embedding(TOKENS, 8, name="tokens")(ids)
    attended = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, name="attention")(
        hidden, hidden)
    hidden = keras.layers.LayerNormalization(name="norm")(
        keras.layers.Add(name="residual")([hidden, attended]))
    hidden = keras.layers.Dense(8, activation="relu", name="ffn")(hidden)
    hidden = keras.layers.GlobalAveragePooling1D(name="pool")(hidden)
    return keras.Model(ids, keras.layers.Dense(2, name="out")(hidden), name="transformer")


def _regression(inputs: np.ndarray, outputs: int, seed: int) -> Tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return inputs, rng.normal(size=(SAMPLES, outputs)).astype(np.float32)


def _mlp_data():
    rng = np.random.default_rng(10)
    return _regression(rng.normal(size=(SAMPLES, 6)).astype(np.float32), 3, 11)


def _embedding_data():
    # 128 ids over 50 rows: duplicates within each replica's share and across shares.
    rng = np.random.default_rng(20)
    return _regression(rng.integers(0, VOCABULARY, size=(SAMPLES, 4)).astype(np.int32), 1, 21)


def _cnn_data():
    rng = np.random.default_rng(30)
    return (rng.normal(size=(SAMPLES, 8, 8, 1)).astype(np.float32),
            rng.integers(0, 3, size=(SAMPLES,)).astype(np.int32))


def _transformer_data():
    rng = np.random.default_rng(40)
    return (rng.integers(0, TOKENS, size=(SAMPLES, 6)).astype(np.int32),
            rng.integers(0, 2, size=(SAMPLES,)).astype(np.int32))


_BUILDERS: Dict[str, Callable[[], keras.Model]] = {
    "mlp": _mlp, "embedding": _embedding, "cnn": _cnn, "transformer": _transformer}
_DATA = {"mlp": _mlp_data, "embedding": _embedding_data, "cnn": _cnn_data,
         "transformer": _transformer_data}
_CLASSIFIERS = {"cnn", "transformer"}
MODELS = tuple(_BUILDERS)


def build(name: str, seed: int = 0) -> keras.Model:
    """A fresh, uncompiled model ``name`` whose initial weights depend only on ``seed``."""
    keras.utils.set_random_seed(seed)
    return _BUILDERS[name]()


def data(name: str) -> Tuple[np.ndarray, np.ndarray]:
    """The model's fixed (inputs, targets), ``SAMPLES`` rows each."""
    return _DATA[name]()


def loss(name: str) -> keras.losses.Loss:
    """The model's loss, a mean over the batch."""
    if name in _CLASSIFIERS:
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return keras.losses.MeanSquaredError()


def metrics(name: str) -> list:
    """What ``compile`` tracks besides the loss."""
    return ["sparse_categorical_accuracy"] if name in _CLASSIFIERS else ["mae"]


def compiled(name: str, optimizer: keras.optimizers.Optimizer, seed: int = 0,
             **compile_kwargs) -> keras.Model:
    """``build(name, seed)`` compiled with its loss, its metrics and ``optimizer``."""
    model = build(name, seed)
    model.compile(optimizer=optimizer, loss=loss(name), metrics=metrics(name), **compile_kwargs)
    return model


def make_train_step(model: keras.Model, optimizer: keras.optimizers.Optimizer,
                    loss_fn: keras.losses.Loss) -> Callable:
    """A custom training step (GradientTape + apply_gradients) returning the batch's loss."""

    def train_step(x, y):
        with tf.GradientTape() as tape:
            value = loss_fn(y, model(x, training=True))
        grads = tape.gradient(value, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return value

    return train_step


def batches(x: np.ndarray, y: np.ndarray, size: int = BATCH_SIZE):
    """The data in order, ``size`` rows at a time."""
    for start in range(0, len(x), size):
        yield x[start:start + size], y[start:start + size]
