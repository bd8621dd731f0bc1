"""A corpus of Keras training scripts written the way Keras users write them.

Each script is a function ``script(env)`` that builds a model, compiles it and
trains it on a small synthetic data set (numpy, fixed seeds), then returns a
``Result``: what training left behind (weights, optimizer variables, History,
per-step losses and whatever else the script produced, such as a checkpoint
or a CSV log). ``tests/test_keras_corpus.py`` runs every script twice, once
on a single device and once through AutoDist, and compares the two results.

The only thing a script does differently from the single-device original is
where it builds and compiles its model (``with env.scope():``) and how it
compiles a custom training step (``env.function`` instead of ``tf.function``).
Everything else (callbacks, History, evaluate, predict, eager Keras code
between steps) is plain Keras.

The scripts avoid what AutoDist documents as differing from single-device
training by design (dropout masks, batch-normalization batch statistics): each
would otherwise hide every other difference.
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import pathlib
import tempfile
from typing import Callable, Dict, Optional

import keras
import numpy as np
import tensorflow as tf
from keras import layers, ops


# ----------------------------------------------------------------------------- harness

@dataclasses.dataclass
class Env:
    """Where a script runs.

    Attributes:
        scope: a context manager factory to build and compile models in
            (``ad.scope`` or a no-op).
        function: compiles a custom training step (``ad.function`` or ``tf.function``).
        workdir: a fresh directory for checkpoints and logs.
        name: "single" or the builder's name, for messages.
    """

    scope: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    function: Callable = tf.function
    workdir: Optional[pathlib.Path] = None
    name: str = "single"
    node: int = 0
    nodes: int = 1

    def __post_init__(self):
        if self.workdir is None:
            self.workdir = pathlib.Path(tempfile.mkdtemp(prefix="keras_corpus_"))

    def shard(self, batch_size: int, *arrays) -> tuple:
        """This node's rows of every global batch of ``batch_size`` rows, and its batch size.

        On one node, the arrays whole. On ``nodes`` nodes of one replica each,
        node k feeds rows [k*b, (k+1)*b) of each global batch, b = batch_size / nodes,
        as a script run on every node of a cluster shards its data.
        """
        if self.nodes == 1:
            return (*arrays, batch_size)
        share = batch_size // self.nodes
        assert share * self.nodes == batch_size and len(arrays[0]) % batch_size == 0
        rows = np.concatenate([np.arange(start + self.node * share, start + (self.node + 1) * share)
                               for start in range(0, len(arrays[0]), batch_size)])
        return (*[a[rows] for a in arrays], share)


@dataclasses.dataclass
class Result:
    """What a training run left, in the model's and the optimizer's own order."""

    weights: list
    optimizer_variables: Dict[str, np.ndarray]
    history: dict
    losses: list
    extras: dict


def _optimizer_variables(optimizer, prefix: str = "") -> Dict[str, np.ndarray]:
    # The optimizer's own (uniquified) name is dropped: "adam_3/dense_kernel_momentum".
    return {prefix + v.path.split("/", 1)[-1]: np.array(v.numpy()) for v in optimizer.variables}


def result(models, optimizers, history=None, losses=(), **extras) -> Result:
    """Snapshots ``models`` (one or a list) and ``optimizers`` (one, a list or a dict)."""
    models = models if isinstance(models, (list, tuple)) else [models]
    if isinstance(optimizers, dict):
        variables = {}
        for prefix, optimizer in optimizers.items():
            variables.update(_optimizer_variables(optimizer, prefix + ":"))
    else:
        variables = _optimizer_variables(optimizers)
    history = history.history if isinstance(history, keras.callbacks.History) else history
    return Result(
        weights=[np.array(w.numpy()) for m in models for w in m.weights],
        optimizer_variables=variables,
        history={k: [float(v) for v in vs] for k, vs in (history or {}).items()},
        losses=[float(v) for v in losses],
        extras=extras)


def _read_csv(path: pathlib.Path) -> dict:
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    return {key: [float(row[key]) for row in rows] for key in rows[0]}


def _fresh_start(seed: int) -> None:
    """What a script starts with: a fresh Keras session (so layers are named alike) and a seed."""
    keras.backend.clear_session()
    keras.utils.set_random_seed(seed)


# ----------------------------------------------------------------------------- 1. CNN + callbacks

def cnn_with_callbacks(env: Env) -> Result:
    """Sequential CNN, validation_split, EarlyStopping + ModelCheckpoint + CSVLogger."""
    rng = np.random.default_rng(101)
    x_train = rng.normal(size=(48, 10, 10, 1)).astype("float32")
    # Three classes from the mean brightness of the top and bottom halves.
    y_train = ((x_train[:, :5].mean(axis=(1, 2, 3)) > 0).astype("int32")
               + (x_train[:, 5:].mean(axis=(1, 2, 3)) > 0).astype("int32"))

    _fresh_start(1)
    with env.scope():
        model = keras.Sequential([
            keras.Input(shape=(10, 10, 1)),
            layers.Conv2D(8, kernel_size=(3, 3), activation="relu"),
            layers.MaxPooling2D(pool_size=(2, 2)),
            layers.Conv2D(8, kernel_size=(3, 3), activation="relu"),
            layers.Flatten(),
            layers.Dense(3, activation="softmax"),
        ])
        model.compile(loss="sparse_categorical_crossentropy",
                      optimizer=keras.optimizers.Adam(learning_rate=0.01),
                      metrics=["accuracy"])

    checkpoint_path = env.workdir / "best_model.keras"
    log_path = env.workdir / "training_log.csv"
    callbacks = [
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, restore_best_weights=True),
        keras.callbacks.ModelCheckpoint(filepath=str(checkpoint_path), monitor="val_loss",
                                        save_best_only=True),
        keras.callbacks.CSVLogger(str(log_path)),
    ]
    # 36 training rows in batches of 8, 8, 8, 8, 4; the last 12 rows validate.
    history = model.fit(x_train, y_train, batch_size=8, epochs=4, validation_split=0.25,
                        shuffle=False, callbacks=callbacks, verbose=0)
    best = keras.models.load_model(checkpoint_path)
    score = model.evaluate(x_train, y_train, batch_size=16, verbose=0)
    return result(model, model.optimizer, history,
                  best_checkpoint=[w for w in best.get_weights()],
                  csv_log=_read_csv(log_path), evaluate=score,
                  epochs_run=len(history.history["loss"]))


# ----------------------------------------------------------------------------- 2. LR callbacks

def _regression_data(rows: int = 32, features: int = 6, seed: int = 202):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, features)).astype("float32")
    w = rng.normal(size=(features, 1)).astype("float32")
    y = (np.tanh(x @ w) + 0.1 * rng.normal(size=(rows, 1))).astype("float32")
    return x, y


def _small_regressor() -> keras.Model:
    return keras.Sequential([
        keras.Input(shape=(6,)),
        layers.Dense(16, activation="relu"),
        layers.Dense(1),
    ])


def lr_scheduler(env: Env) -> Result:
    """LearningRateScheduler halving the rate after the first epoch."""
    x, y = _regression_data()

    def scheduler(epoch, lr):
        if epoch < 1:
            return lr
        return lr * 0.5

    x, y, batch_size = env.shard(8, x, y)
    _fresh_start(2)
    with env.scope():
        model = _small_regressor()
        model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.05, momentum=0.9),
                      loss="mse", metrics=["mae"])
    history = model.fit(x, y, epochs=3, batch_size=batch_size, shuffle=False, verbose=0,
                        callbacks=[keras.callbacks.LearningRateScheduler(scheduler)])
    return result(model, model.optimizer, history,
                  final_learning_rate=float(model.optimizer.learning_rate.numpy()))


def lr_drops_to_zero(env: Env) -> Result:
    """A schedule that stops training after epoch 0: the second epoch must not move."""
    x, y = _regression_data(seed=203)
    _fresh_start(3)
    with env.scope():
        model = _small_regressor()
        model.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse")
    after_epoch = []
    record = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: after_epoch.append(model.get_weights()[0].copy()))
    history = model.fit(
        x, y, epochs=2, batch_size=8, shuffle=False, verbose=0,
        callbacks=[keras.callbacks.LearningRateScheduler(lambda epoch: 0.02 if epoch == 0
                                                         else 0.0), record])
    return result(model, model.optimizer, history,
                  epoch_1_change=float(np.abs(after_epoch[1] - after_epoch[0]).max()))


class LinearWarmup(keras.callbacks.Callback):
    """Raises the learning rate linearly over the first steps, batch by batch."""

    def __init__(self, target: float, warmup_steps: int):
        super().__init__()
        self.target = target
        self.warmup_steps = warmup_steps
        self.seen = []

    def on_train_batch_begin(self, batch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())
        if step < self.warmup_steps:
            self.model.optimizer.learning_rate = self.target * (step + 1) / self.warmup_steps
        self.seen.append(float(self.model.optimizer.learning_rate.numpy()))


def lr_warmup_callback(env: Env) -> Result:
    """A custom callback setting the learning rate before every batch (warmup)."""
    x, y = _regression_data(seed=204)
    _fresh_start(4)
    with env.scope():
        model = _small_regressor()
        model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    warmup = LinearWarmup(target=0.05, warmup_steps=6)
    history = model.fit(x, y, epochs=2, batch_size=8, shuffle=False, verbose=0,
                        callbacks=[warmup])
    return result(model, model.optimizer, history, learning_rates=warmup.seen)


def reduce_lr_on_plateau(env: Env) -> Result:
    """ReduceLROnPlateau with a min_delta every epoch falls short of: it fires each time."""
    x, y = _regression_data(seed=205)
    _fresh_start(5)
    with env.scope():
        model = _small_regressor()
        model.compile(optimizer=keras.optimizers.RMSprop(learning_rate=0.02), loss="mse",
                      metrics=["mae"])
    reduce_lr = keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.2, patience=0,
                                                  min_delta=10.0, min_lr=1e-4)
    history = model.fit(x, y, epochs=3, batch_size=8, shuffle=False, verbose=0,
                        callbacks=[reduce_lr])
    return result(model, model.optimizer, history,
                  final_learning_rate=float(model.optimizer.learning_rate.numpy()))


# ----------------------------------------------------------------------------- 4. train_step

class CustomModel(keras.Model):
    """Overrides train_step, tracking the loss with a Mean and MAE by hand."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
        self.loss_fn = keras.losses.MeanSquaredError()

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.loss_fn(y, y_pred)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        self.loss_tracker.update_state(loss)
        self.mae_metric.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

    @property
    def metrics(self):
        # Listed here so that Keras resets them at the start of every epoch.
        return [self.loss_tracker, self.mae_metric]


def custom_train_step_loss_tracker(env: Env) -> Result:
    x, y, batch_size = env.shard(8, *_regression_data(seed=206))
    _fresh_start(6)
    with env.scope():
        inputs = keras.Input(shape=(6,))
        hidden = layers.Dense(16, activation="relu")(inputs)
        outputs = layers.Dense(1)(hidden)
        model = CustomModel(inputs, outputs)
        model.compile(optimizer=keras.optimizers.Adam(0.01))
    history = model.fit(x, y, epochs=2, batch_size=batch_size, shuffle=False, verbose=0)
    return result(model, model.optimizer, history,
                  tracker=[v.numpy() for v in model.loss_tracker.variables],
                  mae=[v.numpy() for v in model.mae_metric.variables])


class ComputeLossModel(keras.Model):
    """Overrides train_step but keeps compile's loss and metrics (self.compute_loss)."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def custom_train_step_compute_loss(env: Env) -> Result:
    x, y = _regression_data(seed=207)
    _fresh_start(7)
    with env.scope():
        inputs = keras.Input(shape=(6,))
        outputs = layers.Dense(1)(layers.Dense(16, activation="relu")(inputs))
        model = ComputeLossModel(inputs, outputs)
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    history = model.fit(x, y, epochs=2, batch_size=8, shuffle=False, verbose=0)
    return result(model, model.optimizer, history)


# ----------------------------------------------------------------------------- 5. multi-IO

def multi_input_multi_output(env: Env) -> Result:
    """Functional model: a title (Embedding + LSTM) and numeric features; two heads."""
    rng = np.random.default_rng(105)
    rows, vocab, title_len = 32, 40, 7
    title = rng.integers(1, vocab, size=(rows, title_len)).astype("int32")
    features = rng.normal(size=(rows, 5)).astype("float32")
    priority = (features[:, 0] + 0.1 * title[:, 0] > 2.0).astype("float32")[:, None]
    department = (title[:, 1] % 3).astype("int32")

    _fresh_start(8)
    with env.scope():
        title_input = keras.Input(shape=(title_len,), dtype="int32", name="title")
        features_input = keras.Input(shape=(5,), name="features")
        title_embedded = layers.Embedding(vocab, 8)(title_input)
        title_encoded = layers.LSTM(8)(title_embedded)
        features_encoded = layers.Dense(8, activation="relu")(features_input)
        merged = layers.concatenate([title_encoded, features_encoded])
        priority_pred = layers.Dense(1, activation="sigmoid", name="priority")(merged)
        department_pred = layers.Dense(3, activation="softmax", name="department")(merged)
        model = keras.Model(inputs=[title_input, features_input],
                            outputs=[priority_pred, department_pred])
        model.compile(
            optimizer=keras.optimizers.RMSprop(1e-2),
            loss={"priority": keras.losses.BinaryCrossentropy(),
                  "department": keras.losses.SparseCategoricalCrossentropy()},
            loss_weights={"priority": 1.0, "department": 0.2},
            metrics={"priority": ["accuracy"], "department": ["accuracy"]})
    history = model.fit({"title": title, "features": features},
                        {"priority": priority, "department": department},
                        epochs=2, batch_size=8, shuffle=False, verbose=0)
    predicted = model.predict({"title": title[:8], "features": features[:8]}, verbose=0)
    return result(model, model.optimizer, history, predictions=list(predicted))


# ----------------------------------------------------------------------------- 6. class_weight

def imbalanced_class_weight(env: Env) -> Result:
    rng = np.random.default_rng(106)
    # 61 rows in batches of 16, 16, 16, 13: the last one splits 6 / 7 over two replicas.
    x = rng.normal(size=(61, 8)).astype("float32")
    y = (x[:, 0] + 0.5 * x[:, 1] > 1.3).astype("int32")  # about 1 in 8 positive
    neg, pos = np.bincount(y)
    class_weight = {0: (1 / neg) * (len(y) / 2.0), 1: (1 / pos) * (len(y) / 2.0)}

    _fresh_start(9)
    with env.scope():
        model = keras.Sequential([
            keras.Input(shape=(8,)),
            layers.Dense(16, activation="relu"),
            layers.Dense(16, activation="relu"),
            layers.Dense(1, activation="sigmoid"),
        ])
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="binary_crossentropy",
                      metrics=[keras.metrics.Precision(name="precision"),
                               keras.metrics.Recall(name="recall"),
                               keras.metrics.AUC(name="auc"),
                               keras.metrics.BinaryAccuracy(name="accuracy")])
    history = model.fit(x, y, batch_size=16, epochs=2, class_weight=class_weight,
                        shuffle=False, verbose=0)
    return result(model, model.optimizer, history, positives=int(pos))


# ----------------------------------------------------------------------------- 7. sample_weight

def sample_weighted_fit(env: Env) -> Result:
    x, y = _regression_data(rows=32, seed=207)
    sample_weight = np.where(np.arange(32) % 4 == 0, 3.0, 0.5).astype("float32")
    _fresh_start(10)
    with env.scope():
        model = _small_regressor()
        model.compile(optimizer=keras.optimizers.Adam(0.02), loss="mean_absolute_error",
                      metrics=["mse"], weighted_metrics=["mae"])
    history = model.fit(x, y, sample_weight=sample_weight, batch_size=8, epochs=2,
                        shuffle=False, verbose=0,
                        validation_data=(x[:16], y[:16], sample_weight[:16]))
    return result(model, model.optimizer, history)


# ----------------------------------------------------------------------------- 8. transformer

class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, **kwargs):
        super().__init__(**kwargs)
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"),
                                     layers.Dense(embed_dim)])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)

    def call(self, inputs):
        attn_output = self.att(inputs, inputs)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        return self.layernorm2(out1 + ffn_output)


class TokenAndPositionEmbedding(layers.Layer):
    """Token embedding plus a learned embedding of each position (static positions)."""

    def __init__(self, maxlen, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        maxlen = ops.shape(x)[-1]
        positions = ops.arange(start=0, stop=maxlen, step=1)
        positions = self.pos_emb(positions)
        x = self.token_emb(x)
        return x + positions


class DynamicPositionEmbedding(TokenAndPositionEmbedding):
    """The same layer written with TensorFlow ops: positions from the runtime shape."""

    def call(self, x):
        positions = tf.range(start=0, limit=tf.shape(x)[-1], delta=1)
        return self.token_emb(x) + self.pos_emb(positions)


def _transformer_classifier(env: Env, embedding_layer) -> Result:
    rng = np.random.default_rng(108)
    vocab_size, maxlen, rows = 30, 10, 32
    x_train = rng.integers(0, vocab_size, size=(rows, maxlen)).astype("int32")
    y_train = (x_train[:, :3].sum(axis=1) > 45).astype("int32")

    _fresh_start(11)
    with env.scope():
        inputs = layers.Input(shape=(maxlen,), dtype="int32")
        x = embedding_layer(maxlen, vocab_size, 8)(inputs)
        x = TransformerBlock(8, num_heads=2, ff_dim=16)(x)
        x = layers.GlobalAveragePooling1D()(x)
        x = layers.Dense(8, activation="relu")(x)
        outputs = layers.Dense(2, activation="softmax")(x)
        model = keras.Model(inputs=inputs, outputs=outputs)
        model.compile(optimizer=keras.optimizers.Adam(learning_rate=0.01),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    x, y, batch_size = env.shard(8, x_train, y_train)
    history = model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0,
                        validation_data=(x_train[:8], y_train[:8]))
    return result(model, model.optimizer, history)


def transformer_position_embedding(env: Env) -> Result:
    """Text classification with a transformer (positions from ops.arange over maxlen)."""
    return _transformer_classifier(env, TokenAndPositionEmbedding)


def transformer_dynamic_positions(env: Env) -> Result:
    """The same classifier, positions from tf.range(tf.shape(x)[-1])."""
    return _transformer_classifier(env, DynamicPositionEmbedding)


# ----------------------------------------------------------------------------- 9. preprocessing

def _structured_data(rows: int = 32):
    rng = np.random.default_rng(109)
    age = rng.integers(20, 70, size=(rows, 1)).astype("float32")
    income = rng.normal(50.0, 15.0, size=(rows, 1)).astype("float32")
    thal = rng.choice(np.array(["fixed", "normal", "reversible"]), size=(rows, 1))
    chest_pain = rng.integers(0, 4, size=(rows, 1)).astype("int64")
    target = ((age[:, 0] > 45) ^ (thal[:, 0] == "normal")).astype("float32")[:, None]
    return {"age": age, "income": income, "thal": thal, "cp": chest_pain}, target


def structured_lookup_layers(env: Env) -> Result:
    """Normalization (adapted), StringLookup and IntegerLookup inside the model."""
    features, target = _structured_data()
    numeric = np.concatenate([features["age"], features["income"]], axis=1)

    _fresh_start(12)
    with env.scope():
        normalizer = layers.Normalization()
        normalizer.adapt(numeric)
        thal_lookup = layers.StringLookup(vocabulary=["fixed", "normal", "reversible"])
        cp_lookup = layers.IntegerLookup(vocabulary=[0, 1, 2, 3], output_mode="one_hot")

        numeric_input = keras.Input(shape=(2,), name="numeric")
        thal_input = keras.Input(shape=(1,), dtype="string", name="thal")
        cp_input = keras.Input(shape=(1,), dtype="int64", name="cp")
        thal_embedded = layers.Flatten()(layers.Embedding(thal_lookup.vocabulary_size(), 4)(
            thal_lookup(thal_input)))
        all_features = layers.concatenate([normalizer(numeric_input), thal_embedded,
                                           cp_lookup(cp_input)])
        x = layers.Dense(16, activation="relu")(all_features)
        output = layers.Dense(1, activation="sigmoid")(x)
        model = keras.Model([numeric_input, thal_input, cp_input], output)
        model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    # Keras takes string columns from a tf.data pipeline, as a data frame's dict.
    train_ds = tf.data.Dataset.from_tensor_slices(
        ({"numeric": numeric, "thal": features["thal"], "cp": features["cp"]},
         target)).batch(8)
    history = model.fit(train_ds, epochs=2, verbose=0)
    return result(model, model.optimizer, history)


def structured_hashing(env: Env) -> Result:
    """Normalization (adapted) and Hashing feeding an Embedding: no lookup table."""
    features, target = _structured_data()
    numeric = np.concatenate([features["age"], features["income"]], axis=1)

    _fresh_start(13)
    with env.scope():
        normalizer = layers.Normalization(axis=-1)
        normalizer.adapt(numeric)
        numeric_input = keras.Input(shape=(2,), name="numeric")
        thal_input = keras.Input(shape=(1,), dtype="string", name="thal")
        hashed = layers.Hashing(num_bins=16)(thal_input)
        thal_embedded = layers.Flatten()(layers.Embedding(16, 4)(hashed))
        x = layers.concatenate([normalizer(numeric_input), thal_embedded])
        x = layers.Dense(16, activation="relu")(x)
        output = layers.Dense(1, activation="sigmoid")(x)
        model = keras.Model([numeric_input, thal_input], output)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="binary_crossentropy",
                      metrics=["accuracy", keras.metrics.AUC(name="auc")])
    train_ds = tf.data.Dataset.from_tensor_slices(
        ({"numeric": numeric, "thal": features["thal"]}, target)).batch(8)
    history = model.fit(train_ds, epochs=2, verbose=0)
    return result(model, model.optimizer, history,
                  normalizer_state=[w for w in normalizer.get_weights()])


def structured_lookup_in_dataset(env: Env) -> Result:
    """StringLookup applied in the tf.data pipeline (dataset.map); the model sees ids."""
    features, target = _structured_data()
    lookup = layers.StringLookup(vocabulary=["fixed", "normal", "reversible"])

    def encode(inputs, label):
        return {"age": inputs["age"], "income": inputs["income"],
                "thal": lookup(inputs["thal"])}, label

    dataset = tf.data.Dataset.from_tensor_slices(
        ({"age": features["age"], "income": features["income"], "thal": features["thal"]},
         target))
    dataset = dataset.batch(8).map(encode)

    _fresh_start(14)
    with env.scope():
        age = keras.Input(shape=(1,), name="age")
        income = keras.Input(shape=(1,), name="income")
        thal = keras.Input(shape=(1,), dtype="int64", name="thal")
        thal_embedded = layers.Flatten()(layers.Embedding(lookup.vocabulary_size(), 4)(thal))
        x = layers.concatenate([age / 70.0, (income - 50.0) / 15.0, thal_embedded])
        x = layers.Dense(8, activation="relu")(x)
        output = layers.Dense(1, activation="sigmoid")(x)
        model = keras.Model([age, income, thal], output)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="binary_crossentropy",
                      metrics=["accuracy"])
    history = model.fit(dataset, epochs=2, verbose=0)
    return result(model, model.optimizer, history)


# ----------------------------------------------------------------------------- 10. mixed precision

def mixed_precision(env: Env) -> Result:
    x, y = _regression_data(rows=32, seed=210)
    _fresh_start(15)  # before the policy: clear_session resets it
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with env.scope():
            inputs = keras.Input(shape=(6,))
            x_ = layers.Dense(16, activation="relu")(inputs)
            x_ = layers.Dense(1)(x_)
            # The output in float32 for numeric stability, as the guide recommends.
            outputs = layers.Activation("linear", dtype="float32")(x_)
            model = keras.Model(inputs, outputs)
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return result(model, model.optimizer, history,
                      compute_dtype=[layer.compute_dtype == "float16"
                                     for layer in model.layers[1:-1]],
                      loss_scaled=isinstance(model.optimizer,
                                             keras.optimizers.LossScaleOptimizer))
    finally:
        keras.mixed_precision.set_global_policy("float32")


# ----------------------------------------------------------------------------- 11. GAN

LATENT_DIM = 4


def _gan_parts():
    discriminator = keras.Sequential([
        keras.Input(shape=(6,)),
        layers.Dense(16),
        layers.LeakyReLU(negative_slope=0.2),
        layers.Dense(1),
    ], name="discriminator")
    generator = keras.Sequential([
        keras.Input(shape=(LATENT_DIM,)),
        layers.Dense(16),
        layers.LeakyReLU(negative_slope=0.2),
        layers.Dense(6),
    ], name="generator")
    return discriminator, generator


def _gan_data():
    rng = np.random.default_rng(111)
    real = (rng.normal(size=(32, 6)) * 0.5 + 1.0).astype("float32")
    # The noise is drawn outside the step, so that both runs see the same draws.
    noise = [rng.normal(size=(8, LATENT_DIM)).astype("float32") for _ in range(8)]
    return real, noise


def gan_custom_loop(env: Env) -> Result:
    """A GAN trained from scratch: one step updates the discriminator, then the generator."""
    real_data, noise = _gan_data()
    _fresh_start(16)
    with env.scope():
        discriminator, generator = _gan_parts()
        d_optimizer = keras.optimizers.Adam(learning_rate=0.003)
        g_optimizer = keras.optimizers.Adam(learning_rate=0.004)
        loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

    @env.function
    def train_step(real_images, random_latent_vectors):
        generated_images = generator(random_latent_vectors)
        combined_images = tf.concat([generated_images, real_images], axis=0)
        batch_size = tf.shape(real_images)[0]
        labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
        with tf.GradientTape() as tape:
            predictions = discriminator(combined_images)
            d_loss = loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, discriminator.trainable_weights)
        d_optimizer.apply_gradients(zip(grads, discriminator.trainable_weights))

        misleading_labels = tf.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            predictions = discriminator(generator(random_latent_vectors))
            g_loss = loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, generator.trainable_weights)
        g_optimizer.apply_gradients(zip(grads, generator.trainable_weights))
        return d_loss, g_loss

    losses = []
    dataset = tf.data.Dataset.from_tensor_slices(real_data).batch(8)
    for epoch in range(2):
        for step, real_images in enumerate(dataset):
            d_loss, g_loss = train_step(real_images, noise[epoch * 4 + step])
            losses += [d_loss, g_loss]
    return result([generator, discriminator], {"d": d_optimizer, "g": g_optimizer},
                  losses=losses)


class GAN(keras.Model):
    """A GAN whose train_step fit runs: compile takes one optimizer per network."""

    def __init__(self, discriminator, generator):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def train_step(self, data):
        real_images, random_latent_vectors = data
        batch_size = tf.shape(real_images)[0]
        generated_images = self.generator(random_latent_vectors)
        combined_images = tf.concat([generated_images, real_images], axis=0)
        labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(combined_images))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(random_latent_vectors))
            g_loss = self.loss_fn(tf.zeros((batch_size, 1)), predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


def gan_overriding_train_step(env: Env) -> Result:
    real_data, noise = _gan_data()
    _fresh_start(17)
    with env.scope():
        discriminator, generator = _gan_parts()
        gan = GAN(discriminator=discriminator, generator=generator)
        gan.compile(d_optimizer=keras.optimizers.Adam(0.003),
                    g_optimizer=keras.optimizers.Adam(0.004),
                    loss_fn=keras.losses.BinaryCrossentropy(from_logits=True))
    history = gan.fit(real_data, np.concatenate(noise[:4]), batch_size=8, epochs=2,
                      shuffle=False, verbose=0)
    return result([generator, discriminator], {"d": gan.d_optimizer, "g": gan.g_optimizer},
                  history)


# ----------------------------------------------------------------------------- 12. time series

def timeseries_gru(env: Env) -> Result:
    """GRU forecaster on windows from keras.utils.timeseries_dataset_from_array."""
    rng = np.random.default_rng(112)
    t = np.arange(80, dtype="float32")
    series = np.stack([np.sin(t / 5.0), np.cos(t / 7.0)], axis=1)
    series += 0.05 * rng.normal(size=series.shape).astype("float32")
    series = series.astype("float32")
    sequence_length = 6
    # Predict the first feature one step after each window.
    train_ds = keras.utils.timeseries_dataset_from_array(
        series[:-sequence_length], targets=series[sequence_length:, 0],
        sequence_length=sequence_length, batch_size=16, end_index=57)
    val_ds = keras.utils.timeseries_dataset_from_array(
        series[:-sequence_length], targets=series[sequence_length:, 0],
        sequence_length=sequence_length, batch_size=16, start_index=57)

    _fresh_start(18)
    with env.scope():
        inputs = keras.Input(shape=(sequence_length, 2))
        x = layers.GRU(8)(inputs)
        outputs = layers.Dense(1)(x)
        model = keras.Model(inputs, outputs)
        model.compile(optimizer=keras.optimizers.Adam(learning_rate=0.01), loss="mse",
                      metrics=["mae"])
    history = model.fit(train_ds, epochs=2, validation_data=val_ds, verbose=0)
    return result(model, model.optimizer, history,
                  evaluate=model.evaluate(val_ds, verbose=0))


def lstm_stacked_sequences(env: Env) -> Result:
    """Two stacked LSTMs (return_sequences) on a sequence regression, with gradient clipping."""
    rng = np.random.default_rng(113)
    x = rng.normal(size=(32, 5, 3)).astype("float32")
    y = x.sum(axis=(1, 2))[:, None].astype("float32") / 4.0
    _fresh_start(19)
    with env.scope():
        model = keras.Sequential([
            keras.Input(shape=(5, 3)),
            layers.LSTM(8, return_sequences=True),
            layers.LSTM(8),
            layers.Dense(1),
        ])
        model.compile(optimizer=keras.optimizers.Adam(0.01, clipnorm=1.0), loss="mse")
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return result(model, model.optimizer, history)


# ----------------------------------------------------------------------------- 13. tf.data

def tf_data_pipeline(env: Env) -> Result:
    """from_tensor_slices -> batch -> prefetch, one-hot labels, label smoothing, a schedule."""
    rng = np.random.default_rng(114)
    x = rng.normal(size=(48, 10)).astype("float32")
    labels = np.argmax(x[:, :4], axis=1)
    y = keras.utils.to_categorical(labels, num_classes=4).astype("float32")
    train_ds = tf.data.Dataset.from_tensor_slices((x[:32], y[:32]))
    train_ds = train_ds.batch(8).prefetch(tf.data.AUTOTUNE)
    val_ds = tf.data.Dataset.from_tensor_slices((x[32:], y[32:])).batch(8).cache()

    _fresh_start(20)
    with env.scope():
        model = keras.Sequential([
            keras.Input(shape=(10,)),
            layers.Dense(32, activation="relu"),
            layers.Dense(4, activation="softmax"),
        ])
        lr_schedule = keras.optimizers.schedules.CosineDecay(
            initial_learning_rate=0.0, decay_steps=6, warmup_target=0.02, warmup_steps=2)
        model.compile(optimizer=keras.optimizers.Adam(lr_schedule),
                      loss=keras.losses.CategoricalCrossentropy(label_smoothing=0.1),
                      metrics=["categorical_accuracy",
                               keras.metrics.TopKCategoricalAccuracy(k=2, name="top2")])
    history = model.fit(train_ds, validation_data=val_ds, epochs=2, verbose=0)
    return result(model, model.optimizer, history,
                  predict=model.predict(val_ds, verbose=0))


def repeated_dataset_steps_per_epoch(env: Env) -> Result:
    """An infinite (repeated) dataset with steps_per_epoch and validation_steps."""
    x, y = _regression_data(rows=24, seed=215)
    train_ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()
    val_ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()
    _fresh_start(21)
    with env.scope():
        model = _small_regressor()
        model.compile(optimizer=keras.optimizers.SGD(0.05, nesterov=True, momentum=0.9),
                      loss="huber")
    history = model.fit(train_ds, epochs=3, steps_per_epoch=4, validation_data=val_ds,
                        validation_steps=2, verbose=0)
    return result(model, model.optimizer, history)


# ----------------------------------------------------------------------------- 14. custom loops

def _classification_data(rows: int = 32, seed: int = 116):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 8)).astype("float32")
    y = (np.argmax(x[:, :3], axis=1)).astype("int32")
    return x, y


def _small_classifier() -> keras.Model:
    inputs = keras.Input(shape=(8,), name="digits")
    x = layers.Dense(16, activation="relu", name="dense_1")(inputs)
    outputs = layers.Dense(3, name="predictions")(x)
    return keras.Model(inputs=inputs, outputs=outputs)


def custom_loop_static_batch(env: Env) -> Result:
    """GradientTape loop dividing a summed loss by the static batch size x.shape[0]."""
    x_train, y_train = _classification_data()
    dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train)).batch(8)
    _fresh_start(22)
    with env.scope():
        model = _small_classifier()
        optimizer = keras.optimizers.SGD(learning_rate=0.1)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="sum")
        train_acc_metric = keras.metrics.SparseCategoricalAccuracy()

    @env.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss_value = loss_fn(y, logits) / x.shape[0]
        grads = tape.gradient(loss_value, model.trainable_weights)
        optimizer.apply_gradients(zip(grads, model.trainable_weights))
        train_acc_metric.update_state(y, logits)
        return loss_value

    losses, accuracy = [], []
    for epoch in range(2):
        for x_batch, y_batch in dataset:
            losses.append(train_step(x_batch, y_batch))
        accuracy.append(float(train_acc_metric.result()))
        train_acc_metric.reset_state()
    return result(model, optimizer, losses=losses, train_accuracy=accuracy)


def custom_loop_with_validation(env: Env) -> Result:
    """The from-scratch loop: train step via env.function, a tf.function test step,
    metrics read and reset eagerly at the end of every epoch."""
    x, y = _classification_data(rows=48, seed=117)
    train_dataset = tf.data.Dataset.from_tensor_slices((x[:32], y[:32])).batch(8)
    val_dataset = tf.data.Dataset.from_tensor_slices((x[32:], y[32:])).batch(8)
    _fresh_start(23)
    with env.scope():
        model = _small_classifier()
        optimizer = keras.optimizers.Adam(learning_rate=1e-2)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        train_acc_metric = keras.metrics.SparseCategoricalAccuracy()
    val_acc_metric = keras.metrics.SparseCategoricalAccuracy()

    @env.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss_value = loss_fn(y, logits)
        grads = tape.gradient(loss_value, model.trainable_weights)
        optimizer.apply(grads, model.trainable_weights)
        train_acc_metric.update_state(y, logits)
        return loss_value

    @tf.function
    def test_step(x, y):
        val_acc_metric.update_state(y, model(x, training=False))

    losses, history = [], {"accuracy": [], "val_accuracy": []}
    for epoch in range(2):
        for x_batch, y_batch in train_dataset:
            losses.append(train_step(x_batch, y_batch))
        history["accuracy"].append(train_acc_metric.result())
        train_acc_metric.reset_state()
        for x_batch, y_batch in val_dataset:
            test_step(x_batch, y_batch)
        history["val_accuracy"].append(val_acc_metric.result())
        val_acc_metric.reset_state()
    return result(model, optimizer, history, losses)


def train_on_batch_loop(env: Env) -> Result:
    """A hand-written epoch loop over model.train_on_batch, then test_on_batch."""
    x, y = _classification_data(rows=32, seed=118)
    _fresh_start(24)
    with env.scope():
        model = _small_classifier()
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    logs = []
    for epoch in range(2):
        model.reset_metrics()
        for start in range(0, 32, 8):
            out = model.train_on_batch(x[start:start + 8], y[start:start + 8], return_dict=True)
            logs.append([out["loss"], out["accuracy"]])
    test = model.test_on_batch(x[:16], y[:16])
    return result(model, model.optimizer, logs=logs, test=test)


# ----------------------------------------------------------------------------- more patterns

def transfer_learning_fine_tune(env: Env) -> Result:
    """Freeze a base, train the head, unfreeze, recompile with a lower rate, train again."""
    rng = np.random.default_rng(119)
    x = rng.normal(size=(32, 12, 12, 3)).astype("float32")
    y = (x[..., 0].mean(axis=(1, 2)) > 0).astype("float32")
    _fresh_start(25)
    with env.scope():
        base_model = keras.Sequential([
            keras.Input(shape=(12, 12, 3)),
            layers.Conv2D(6, 3, activation="relu"),
            layers.Conv2D(6, 3, activation="relu"),
        ], name="base")
        base_model.trainable = False
        inputs = keras.Input(shape=(12, 12, 3))
        features = base_model(inputs, training=False)
        features = layers.GlobalAveragePooling2D()(features)
        outputs = layers.Dense(1)(features)
        model = keras.Model(inputs, outputs)
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.BinaryCrossentropy(from_logits=True),
                      metrics=[keras.metrics.BinaryAccuracy()])
    first = model.fit(x, y, epochs=2, batch_size=8, shuffle=False, verbose=0)
    head_optimizer = _optimizer_variables(model.optimizer)

    base_model.trainable = True
    with env.scope():
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.BinaryCrossentropy(from_logits=True),
                      metrics=[keras.metrics.BinaryAccuracy()])
    second = model.fit(x, y, epochs=2, batch_size=8, shuffle=False, verbose=0)
    history = {f"first_{k}": v for k, v in first.history.items()}
    history.update({f"second_{k}": v for k, v in second.history.items()})
    return result(model, model.optimizer, history, head_optimizer=head_optimizer)


@keras.saving.register_keras_serializable(package="corpus")
def weighted_huber(y_true, y_pred):
    error = y_true - y_pred
    small = ops.abs(error) <= 1.0
    return ops.mean(ops.where(small, 0.5 * ops.square(error), ops.abs(error) - 0.5), axis=-1)


def max_abs_error(y_true, y_pred):
    return ops.max(ops.abs(y_true - y_pred), axis=-1)


def regularized_custom_loss(env: Env) -> Result:
    """kernel/activity regularizers, a custom loss function and a custom metric function."""
    x, y = _regression_data(rows=32, seed=220)
    y = np.concatenate([y, 2 * y], axis=1)
    _fresh_start(26)
    with env.scope():
        model = keras.Sequential([
            keras.Input(shape=(6,)),
            layers.Dense(16, activation="relu", kernel_regularizer=keras.regularizers.l2(1e-2),
                         activity_regularizer=keras.regularizers.l1(1e-3)),
            layers.Dense(2, kernel_regularizer=keras.regularizers.L1L2(l1=1e-3, l2=1e-3)),
        ])
        model.compile(optimizer=keras.optimizers.AdamW(0.01, weight_decay=0.01),
                      loss=weighted_huber, metrics=[max_abs_error])
    history = model.fit(x, y, epochs=2, batch_size=8, shuffle=False, verbose=0)
    return result(model, model.optimizer, history)


def conv_autoencoder(env: Env) -> Result:
    """Denoising autoencoder: Conv2D down, Conv2DTranspose up, fit(noisy, clean)."""
    rng = np.random.default_rng(121)
    clean = rng.uniform(size=(32, 8, 8, 1)).astype("float32")
    noisy = np.clip(clean + 0.2 * rng.normal(size=clean.shape), 0.0, 1.0).astype("float32")
    _fresh_start(27)
    with env.scope():
        inputs = keras.Input(shape=(8, 8, 1))
        x = layers.Conv2D(4, (3, 3), activation="relu", padding="same")(inputs)
        x = layers.MaxPooling2D((2, 2), padding="same")(x)
        x = layers.Conv2DTranspose(4, (3, 3), strides=2, activation="relu", padding="same")(x)
        outputs = layers.Conv2D(1, (3, 3), activation="sigmoid", padding="same")(x)
        autoencoder = keras.Model(inputs, outputs)
        autoencoder.compile(optimizer=keras.optimizers.Adam(0.01), loss="binary_crossentropy")
    history = autoencoder.fit(noisy, clean, epochs=2, batch_size=8, shuffle=False, verbose=0,
                              validation_data=(noisy[:8], clean[:8]))
    return result(autoencoder, autoencoder.optimizer, history)


def per_batch_lambda_logger(env: Env) -> Result:
    """A LambdaCallback collecting every batch's logs, and a Callback subclass reading
    the weights after each batch."""
    x, y = _classification_data(rows=32, seed=122)
    batch_logs, weight_norms = [], []

    class WeightNorm(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            weight_norms.append(float(np.linalg.norm(self.model.layers[-1].get_weights()[0])))

    _fresh_start(28)
    with env.scope():
        model = _small_classifier()
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    logger = keras.callbacks.LambdaCallback(
        on_batch_end=lambda batch, logs: batch_logs.append([logs["loss"], logs["accuracy"]]))
    history = model.fit(x, y, epochs=2, batch_size=8, shuffle=False, verbose=0,
                        callbacks=[logger, WeightNorm()])
    return result(model, model.optimizer, history, batch_logs=batch_logs,
                  weight_norms=weight_norms)


# ----------------------------------------------------------------------------- even more patterns

def bidirectional_lstm_masked(env: Env) -> Result:
    """Padded sequences: Embedding(mask_zero=True) into a Bidirectional LSTM (masked steps)."""
    rng = np.random.default_rng(123)
    rows, maxlen, vocab = 32, 8, 25
    lengths = rng.integers(2, maxlen + 1, size=rows)
    x = np.zeros((rows, maxlen), dtype="int32")
    for row, length in enumerate(lengths):  # post-padded with 0, as pad_sequences does
        x[row, :length] = rng.integers(1, vocab, size=length)
    y = (x[:, 0] % 2).astype("int32")
    _fresh_start(29)
    with env.scope():
        inputs = keras.Input(shape=(None,), dtype="int32")
        x_ = layers.Embedding(vocab, 8, mask_zero=True)(inputs)
        x_ = layers.Bidirectional(layers.LSTM(6))(x_)
        outputs = layers.Dense(1, activation="sigmoid")(x_)
        model = keras.Model(inputs, outputs)
        model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return result(model, model.optimizer, history)


def siamese_shared_encoder(env: Env) -> Result:
    """One encoder (an Embedding and a Dense) applied to two inputs: shared weights."""
    rng = np.random.default_rng(124)
    rows, length, vocab = 32, 5, 20
    left = rng.integers(0, vocab, size=(rows, length)).astype("int32")
    right = np.where(rng.uniform(size=(rows, 1)) < 0.5, left,
                     rng.integers(0, vocab, size=(rows, length))).astype("int32")
    same = np.all(left == right, axis=1).astype("float32")[:, None]
    _fresh_start(30)
    with env.scope():
        encoder = keras.Sequential([
            keras.Input(shape=(length,), dtype="int32"),
            layers.Embedding(vocab, 6),
            layers.GlobalAveragePooling1D(),
            layers.Dense(8, activation="tanh"),
        ], name="encoder")
        input_a = keras.Input(shape=(length,), dtype="int32")
        input_b = keras.Input(shape=(length,), dtype="int32")
        distance = layers.Lambda(lambda pair: ops.sum(ops.square(pair[0] - pair[1]), axis=1,
                                                      keepdims=True))(
            [encoder(input_a), encoder(input_b)])
        outputs = layers.Dense(1, activation="sigmoid")(distance)
        model = keras.Model([input_a, input_b], outputs)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="binary_crossentropy",
                      metrics=["accuracy"])
    history = model.fit([left, right], same, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return result(model, model.optimizer, history)


class ActivityRegularizationLayer(layers.Layer):
    """Adds a penalty on its inputs' sum to the model's losses."""

    def __init__(self, rate=1e-2, **kwargs):
        super().__init__(**kwargs)
        self.rate = rate

    def call(self, inputs):
        self.add_loss(self.rate * ops.sum(inputs))
        return inputs


class Linear(layers.Layer):
    """A dense layer written from scratch with add_weight."""

    def __init__(self, units=32, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1], self.units),
                                 initializer="random_normal", trainable=True)
        self.b = self.add_weight(shape=(self.units,), initializer="zeros", trainable=True)

    def call(self, inputs):
        return ops.matmul(inputs, self.w) + self.b


def custom_layers_add_loss(env: Env) -> Result:
    """Custom layers from add_weight, one adding a penalty with self.add_loss."""
    x, y = _regression_data(rows=32, seed=225)
    _fresh_start(31)
    with env.scope():
        inputs = keras.Input(shape=(6,))
        x_ = ops.relu(Linear(16)(inputs))
        x_ = ActivityRegularizationLayer(1e-3)(x_)
        outputs = Linear(1)(x_)
        model = keras.Model(inputs, outputs)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return result(model, model.optimizer, history)


class BatchGenerator(keras.utils.PyDataset):
    """Serves (x, y) batches by index, as a data generator does."""

    def __init__(self, x, y, batch_size, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return int(np.ceil(len(self.x) / self.batch_size))

    def __getitem__(self, index):
        low = index * self.batch_size
        high = min(low + self.batch_size, len(self.x))
        return self.x[low:high], self.y[low:high]


def pydataset_generator(env: Env) -> Result:
    """fit on a keras.utils.PyDataset (a Sequence-style generator) with a short last batch."""
    x, y = _classification_data(rows=30, seed=126)  # batches of 8, 8, 8, 6
    _fresh_start(32)
    with env.scope():
        model = _small_classifier()
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    history = model.fit(BatchGenerator(x, y, batch_size=8), epochs=2, verbose=0,
                        validation_data=BatchGenerator(x[:16], y[:16], batch_size=8))
    return result(model, model.optimizer, history)


def optimizer_nadam(env: Env) -> Result:
    """Nadam: besides its slots it keeps one scalar (its momentum-cache product)."""
    x, y = _regression_data(rows=32, seed=227)
    _fresh_start(33)
    with env.scope():
        model = _small_regressor()
        model.compile(optimizer=keras.optimizers.Nadam(0.01), loss="mse", metrics=["mae"])
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return result(model, model.optimizer, history)


def optimizer_ema(env: Env) -> Result:
    """An optimizer keeping an exponential moving average of the weights (use_ema)."""
    x, y = _regression_data(rows=32, seed=228)
    _fresh_start(34)
    with env.scope():
        model = _small_regressor()
        model.compile(optimizer=keras.optimizers.AdamW(0.01, use_ema=True, ema_momentum=0.9),
                      loss="mse")
    # At its end fit overwrites the weights with their moving averages.
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return result(model, model.optimizer, history,
                  predict=model.predict(x[:8], verbose=0))


SCRIPTS: Dict[str, Callable[[Env], Result]] = {
    "cnn_with_callbacks": cnn_with_callbacks,
    "lr_scheduler": lr_scheduler,
    "lr_drops_to_zero": lr_drops_to_zero,
    "lr_warmup_callback": lr_warmup_callback,
    "reduce_lr_on_plateau": reduce_lr_on_plateau,
    "custom_train_step_loss_tracker": custom_train_step_loss_tracker,
    "custom_train_step_compute_loss": custom_train_step_compute_loss,
    "multi_input_multi_output": multi_input_multi_output,
    "imbalanced_class_weight": imbalanced_class_weight,
    "sample_weighted_fit": sample_weighted_fit,
    "transformer_position_embedding": transformer_position_embedding,
    "transformer_dynamic_positions": transformer_dynamic_positions,
    "structured_lookup_layers": structured_lookup_layers,
    "structured_hashing": structured_hashing,
    "structured_lookup_in_dataset": structured_lookup_in_dataset,
    "mixed_precision": mixed_precision,
    "gan_custom_loop": gan_custom_loop,
    "gan_overriding_train_step": gan_overriding_train_step,
    "timeseries_gru": timeseries_gru,
    "lstm_stacked_sequences": lstm_stacked_sequences,
    "tf_data_pipeline": tf_data_pipeline,
    "repeated_dataset_steps_per_epoch": repeated_dataset_steps_per_epoch,
    "custom_loop_static_batch": custom_loop_static_batch,
    "custom_loop_with_validation": custom_loop_with_validation,
    "train_on_batch_loop": train_on_batch_loop,
    "transfer_learning_fine_tune": transfer_learning_fine_tune,
    "regularized_custom_loss": regularized_custom_loss,
    "conv_autoencoder": conv_autoencoder,
    "per_batch_lambda_logger": per_batch_lambda_logger,
    "bidirectional_lstm_masked": bidirectional_lstm_masked,
    "siamese_shared_encoder": siamese_shared_encoder,
    "custom_layers_add_loss": custom_layers_add_loss,
    "pydataset_generator": pydataset_generator,
    "optimizer_nadam": optimizer_nadam,
    "optimizer_ema": optimizer_ema,
}
