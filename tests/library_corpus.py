"""A corpus of models built with the libraries Keras users train with: KerasHub and KerasRS.

Each script builds its model the way the library's documentation does (tasks on
backbones made from their constructors, library layers in functional or
subclassed models, library losses), compiles it, and trains it with ``fit`` on a
small synthetic data set (numpy, fixed seeds). Like ``tests/keras_corpus.py``,
a script takes an ``Env`` and returns a ``Result``;
``tests/test_library_corpus.py`` runs every script on a single device and
through AutoDist and compares the two.

Everything is tiny and randomly initialized: nothing is downloaded (no
``from_preset``), no preprocessor is attached (the data is token ids and
images already), and every dropout rate is 0 (replicas draw their own masks,
which AutoDist documents as differing from a single device).

Per-step losses are the ``loss`` each batch reports to callbacks (the epoch's
running mean so far), recorded by ``StepLosses``.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict

import keras
import keras_hub
import keras_rs
import numpy as np
from keras import layers, ops

import autodist
import keras_corpus as kc
from keras_corpus import Env, Result


class StepLosses(keras.callbacks.Callback):
    """The loss every training batch reports, in order."""

    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def _fit(model, *args, **kwargs):
    """``model.fit`` with a ``StepLosses`` callback; returns (History, per-step losses)."""
    steps = StepLosses()
    history = model.fit(*args, callbacks=[steps], verbose=0, **kwargs)
    return history, steps.losses


def _node_rows(env: Env, batch_size: int, x, *arrays) -> tuple:
    """This node's rows of ``x`` (an array or a dict of arrays) and ``arrays`` in every
    global batch, and its batch size (``Env.shard``): on one node, all of them."""
    names = sorted(x) if isinstance(x, dict) else None
    columns = [x[name] for name in names] if names else [x]
    *rows, share = env.shard(batch_size, *columns, *arrays)
    inputs = dict(zip(names, rows)) if names else rows[0]
    return (inputs, *rows[len(columns):], share)


def _padded_tokens(rows: int, length: int, vocabulary: int, batch_size: int, seed: int,
                   long=(0.75, 1.0), short=(0.2, 0.4)):
    """Token ids padded with 0 and their padding mask, ``rows`` x ``length``.

    In every batch of ``batch_size`` rows the first half of the rows is long
    (``long`` fractions of ``length``) and the second half short: each of two
    replicas then sees a different number of real tokens.
    """
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocabulary, size=(rows, length)).astype("int32")
    first_half = (np.arange(rows) % batch_size) < batch_size // 2
    low = np.where(first_half, long[0], short[0]) * length
    high = np.where(first_half, long[1], short[1]) * length
    lengths = rng.integers(np.ceil(low), np.floor(high) + 1).clip(2, length)
    mask = np.arange(length)[None, :] < lengths[:, None]
    return np.where(mask, tokens, 0).astype("int32"), mask


# ============================================================================= KerasHub

# ----------------------------------------------------------------------------- (a) causal LM

def gpt2_causal_lm(env: Env) -> Result:
    """GPT2CausalLM on a tiny GPT2Backbone, fit on token ids / next tokens / padding weights.

    The data is what GPT2CausalLMPreprocessor would hand fit: x the first
    ``sequence_length`` tokens, y the same shifted by one, sample_weight the
    shifted padding mask. Rows of the two halves of each batch pad to different lengths.
    """
    sequence_length, vocabulary, batch_size = 16, 64, 8
    tokens, mask = _padded_tokens(32, sequence_length + 1, vocabulary, batch_size, seed=701)
    x = {"token_ids": tokens[:, :-1], "padding_mask": mask[:, :-1]}
    y, sample_weight = tokens[:, 1:], mask[:, 1:].astype("float32")

    kc._fresh_start(71)
    with env.scope():
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=vocabulary, num_layers=1, num_heads=2, hidden_dim=16,
            intermediate_dim=32, dropout=0.0, max_sequence_length=sequence_length)
        causal_lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
        causal_lm.compile(
            optimizer=keras.optimizers.Adam(learning_rate=1e-2),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            weighted_metrics=["accuracy"])
    node_x, node_y, node_weight, node_batch = _node_rows(env, batch_size, x, y, sample_weight)
    history, losses = _fit(causal_lm, x=node_x, y=node_y, sample_weight=node_weight,
                           batch_size=node_batch, epochs=1, shuffle=False)
    halves = sample_weight.reshape(-1, 2, batch_size // 2, sequence_length).sum(axis=(2, 3))
    return kc.result(causal_lm, causal_lm.optimizer, history, losses,
                     real_tokens_per_half_batch=halves)


# ----------------------------------------------------------------------------- (b) classifier

def bert_text_classifier(env: Env) -> Result:
    """BertTextClassifier (3 classes) on a tiny BertBackbone, fit on packed sentence pairs."""
    sequence_length, vocabulary, batch_size = 12, 64, 8
    tokens, mask = _padded_tokens(16, sequence_length, vocabulary, batch_size, seed=702,
                                  long=(0.6, 1.0), short=(0.6, 1.0))
    rng = np.random.default_rng(712)
    # The first segment is up to a random split point, the second after it.
    split = rng.integers(2, 6, size=(16, 1))
    segment_ids = ((np.arange(sequence_length)[None, :] >= split) & mask).astype("int32")
    x = {"token_ids": tokens, "segment_ids": segment_ids, "padding_mask": mask}
    y = (tokens[:, 0] % 3).astype("int32")

    kc._fresh_start(72)
    with env.scope():
        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=vocabulary, num_layers=1, num_heads=2, hidden_dim=16,
            intermediate_dim=32, dropout=0.0, max_sequence_length=sequence_length)
        classifier = keras_hub.models.BertTextClassifier(
            backbone=backbone, num_classes=3, preprocessor=None, dropout=0.0)
        classifier.compile(
            optimizer=keras.optimizers.Adam(5e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=[keras.metrics.SparseCategoricalAccuracy()])
    history, losses = _fit(classifier, x=x, y=y, batch_size=batch_size, epochs=2)
    return kc.result(classifier, classifier.optimizer, history, losses)


# ----------------------------------------------------------------------------- (c) seq2seq

def seq2seq_transformer(env: Env) -> Result:
    """An encoder-decoder from KerasHub layers as a functional keras.Model.

    Both embeddings are ``mask_zero=True``: the decoder's padding mask reaches
    the logits, so the loss leaves out the padded target tokens.
    """
    length, vocabulary, batch_size = 8, 32, 8
    source, _ = _padded_tokens(16, length, vocabulary, batch_size, seed=703)
    target, target_mask = _padded_tokens(16, length + 1, vocabulary, batch_size, seed=713)
    decoder_in = target[:, :-1]
    decoder_out = np.where(target_mask[:, :-1], target[:, 1:], 0).astype("int32")

    kc._fresh_start(73)
    with env.scope():
        encoder_inputs = keras.Input(shape=(None,), dtype="int32", name="encoder_inputs")
        x = keras_hub.layers.TokenAndPositionEmbedding(
            vocabulary_size=vocabulary, sequence_length=length, embedding_dim=16,
            mask_zero=True)(encoder_inputs)
        encoder_outputs = keras_hub.layers.TransformerEncoder(
            intermediate_dim=32, num_heads=2)(inputs=x)

        decoder_inputs = keras.Input(shape=(None,), dtype="int32", name="decoder_inputs")
        x = keras_hub.layers.TokenAndPositionEmbedding(
            vocabulary_size=vocabulary, sequence_length=length, embedding_dim=16,
            mask_zero=True)(decoder_inputs)
        x = keras_hub.layers.TransformerDecoder(intermediate_dim=32, num_heads=2)(
            decoder_sequence=x, encoder_sequence=encoder_outputs)
        decoder_outputs = layers.Dense(vocabulary)(x)
        transformer = keras.Model([encoder_inputs, decoder_inputs], decoder_outputs)
        transformer.compile(
            optimizer=keras.optimizers.RMSprop(1e-2),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"])
    node_x, node_y, node_batch = _node_rows(
        env, batch_size, {"encoder_inputs": source, "decoder_inputs": decoder_in}, decoder_out)
    history, losses = _fit(transformer, node_x, node_y, batch_size=node_batch, epochs=2,
                           shuffle=False)
    return kc.result(transformer, transformer.optimizer, history, losses)


# ----------------------------------------------------------------------------- (d) images

def resnet_image_classifier(env: Env) -> Result:
    """ImageClassifier on a tiny ResNetBackbone (batch normalization), 16x16 RGB images."""
    rng = np.random.default_rng(704)
    images = rng.uniform(size=(16, 16, 16, 3)).astype("float32")
    labels = (images[:, :8].mean(axis=(1, 2, 3)) * 3 % 3).astype("int32")

    kc._fresh_start(74)
    with env.scope():
        backbone = keras_hub.models.ResNetBackbone(
            input_conv_filters=[64], input_conv_kernel_sizes=[3],
            stackwise_num_filters=[64], stackwise_num_blocks=[1],
            stackwise_num_strides=[1], block_type="basic_block",
            image_shape=(16, 16, 3))
        classifier = keras_hub.models.ImageClassifier(
            backbone=backbone, num_classes=3, preprocessor=None)
        classifier.compile(
            optimizer=keras.optimizers.SGD(learning_rate=0.05, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"])
    history, losses = _fit(classifier, images, labels, batch_size=8, epochs=2)
    return kc.result(classifier, classifier.optimizer, history, losses)


def synchronized_bn_classifier(env: Env) -> Result:
    """A small residual CNN whose batch normalization is ``synchronized=True`` (the
    statistics of the whole global batch), on images whose halves of each batch differ
    in brightness: statistics per replica or per node would differ from the batch's."""
    rng = np.random.default_rng(705)
    images = rng.uniform(size=(16, 8, 8, 3)).astype("float32")
    images[np.arange(16) % 8 < 4] += 1.0
    labels = (images[:, :4].mean(axis=(1, 2, 3)) * 3 % 3).astype("int32")

    kc._fresh_start(75)
    with env.scope():
        inputs = keras.Input((8, 8, 3))
        x = layers.Conv2D(8, 3, padding="same", use_bias=False)(inputs)
        x = layers.Activation("relu")(layers.BatchNormalization(synchronized=True)(x))
        y = layers.Conv2D(8, 3, padding="same", use_bias=False)(x)
        y = layers.BatchNormalization(synchronized=True)(y)
        x = layers.Activation("relu")(layers.Add()([x, y]))
        outputs = layers.Dense(3)(layers.GlobalAveragePooling2D()(x))
        classifier = keras.Model(inputs, outputs)
        classifier.compile(
            optimizer=keras.optimizers.SGD(learning_rate=0.05, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"])
    node_images, node_labels, node_batch = _node_rows(env, 8, images, labels)
    history, losses = _fit(classifier, node_images, node_labels, batch_size=node_batch,
                           epochs=2, shuffle=False)
    return kc.result(classifier, classifier.optimizer, history, losses)


# ============================================================================= KerasRS

def _click_data(rows: int, vocabularies, dense_features: int, seed: int):
    """Categorical ids (one column per vocabulary), dense features and a 0/1 label."""
    rng = np.random.default_rng(seed)
    ids = {f"cat_{i}": rng.integers(0, v, size=(rows,)).astype("int32")
           for i, v in enumerate(vocabularies)}
    dense = rng.normal(size=(rows, dense_features)).astype("float32")
    score = dense[:, 0] + sum((column % 2) - 0.5 for column in ids.values())
    return ids, dense, (score > 0).astype("float32")[:, None]


# ----------------------------------------------------------------------------- (e) DCN

def dcn_feature_cross(env: Env) -> Result:
    """Deep & Cross Network: embeddings and dense features, two FeatureCross layers, an MLP."""
    vocabularies = (20, 12, 8)
    ids, dense, labels = _click_data(32, vocabularies, 4, seed=705)

    kc._fresh_start(75)
    with env.scope():
        id_inputs = {name: keras.Input(shape=(), dtype="int32", name=name) for name in ids}
        dense_input = keras.Input(shape=(4,), name="dense_features")
        embedded = [layers.Embedding(vocabulary, 4, name=f"{name}_embedding")(id_inputs[name])
                    for name, vocabulary in zip(ids, vocabularies)]
        x0 = layers.Concatenate()([*embedded, dense_input])
        x = keras_rs.layers.FeatureCross()(x0, x0)
        x = keras_rs.layers.FeatureCross(projection_dim=4)(x0, x)
        x = layers.Dense(8, activation="relu")(x)
        output = layers.Dense(1, activation="sigmoid")(x)
        dcn = keras.Model({**id_inputs, "dense_features": dense_input}, output)
        dcn.compile(optimizer=keras.optimizers.Adam(1e-2),
                    loss=keras.losses.BinaryCrossentropy(),
                    metrics=[keras.metrics.AUC(name="auc"), "binary_accuracy"])
    x, y, batch_size = _node_rows(env, 8, {**ids, "dense_features": dense}, labels)
    history, losses = _fit(dcn, x, y, batch_size=batch_size, epochs=2, shuffle=False)
    return kc.result(dcn, dcn.optimizer, history, losses)


# ----------------------------------------------------------------------------- (f) DLRM

def dlrm_dot_interaction(env: Env) -> Result:
    """DLRM: a bottom MLP, DistributedEmbedding tables (keras_rs's CPU path), DotInteraction."""
    vocabularies, embedding_dim = (20, 12, 8), 4
    ids, dense, labels = _click_data(32, vocabularies, 5, seed=706)

    kc._fresh_start(76)
    with env.scope():
        feature_configs = {
            name: keras_rs.layers.FeatureConfig(
                name=name,
                table=keras_rs.layers.TableConfig(
                    name=f"{name}_table", vocabulary_size=vocabulary,
                    embedding_dim=embedding_dim, optimizer="adam",
                    # TableConfig's default initializer is one instance made when
                    # keras_rs is imported, its seed drawn then: a process of its own
                    # (a cluster's node) would start the tables elsewhere.
                    initializer=keras.initializers.VarianceScaling(mode="fan_out",
                                                                   seed=760 + index)),
                input_shape=(None,), output_shape=(None, embedding_dim))
            for index, (name, vocabulary) in enumerate(zip(ids, vocabularies))}
        id_inputs = {name: keras.Input(shape=(), dtype="int32", name=name) for name in ids}
        dense_input = keras.Input(shape=(5,), name="dense_features")
        bottom = layers.Dense(8, activation="relu")(dense_input)
        bottom = layers.Dense(embedding_dim, activation="relu")(bottom)
        embedded = keras_rs.layers.DistributedEmbedding(feature_configs)(id_inputs)
        interactions = keras_rs.layers.DotInteraction()(
            [bottom, *[embedded[name] for name in ids]])
        x = layers.Concatenate()([bottom, interactions])
        x = layers.Dense(8, activation="relu")(x)
        output = layers.Dense(1, activation="sigmoid")(x)
        dlrm = keras.Model({**id_inputs, "dense_features": dense_input}, output)
        dlrm.compile(optimizer=keras.optimizers.Adagrad(0.1),
                     loss=keras.losses.BinaryCrossentropy(),
                     metrics=["binary_accuracy"])
    x, y, batch_size = _node_rows(env, 8, {**ids, "dense_features": dense}, labels)
    history, losses = _fit(dlrm, x, y, batch_size=batch_size, epochs=2, shuffle=False)
    return kc.result(dlrm, dlrm.optimizer, history, losses)


# ----------------------------------------------------------------------------- (g) retrieval

class TwoTowerRetrieval(keras.Model):
    """A query tower and a candidate tower scored against each other within the batch.

    Every query's positive is its own row's candidate; the other rows' candidates
    are its negatives (labels = the identity), of which the hardest few count.
    After training, BruteForceRetrieval serves the top candidates of the whole catalog.
    """

    def __init__(self, users: int, items: int, dim: int = 8, hard_negatives: int = 3,
                 gathered: bool = False, **kwargs):
        super().__init__(**kwargs)
        # Score against every replica's candidates (autodist.gather_batch: on one
        # device, the batch's own), the way AutoDist trains in-batch negatives exactly.
        self.gathered = gathered
        init = keras.initializers.RandomNormal(stddev=0.3)
        self.query_tower = keras.Sequential([layers.Embedding(users, dim, init),
                                             layers.Dense(dim)], name="query_tower")
        # No bias: it adds the same to every score of a query, which a softmax over the
        # candidates ignores, so its gradient is zero up to rounding, which Adam would
        # turn into steps of the learning rate's size.
        self.candidate_tower = keras.Sequential([layers.Embedding(items, dim, init),
                                                 layers.Dense(dim, use_bias=False)],
                                                name="candidate_tower")
        self.hard_negative_mining = keras_rs.layers.HardNegativeMining(hard_negatives)
        self.retrieval = keras_rs.layers.BruteForceRetrieval(k=3, return_scores=False)
        self.loss_fn = keras.losses.CategoricalCrossentropy(from_logits=True)

    def build(self, input_shape):
        self.query_tower.build(input_shape["user_id"])
        self.candidate_tower.build(input_shape["item_id"])

    def call(self, inputs):
        return {"query": self.query_tower(inputs["user_id"]),
                "candidate": self.candidate_tower(inputs["item_id"])}

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        candidates, first = y_pred["candidate"], 0
        if self.gathered:
            candidates, first = autodist.gather_batch(candidates)
        scores = ops.matmul(y_pred["query"], ops.transpose(candidates))
        rows, columns = ops.shape(scores)[0], ops.shape(scores)[1]
        labels = ops.one_hot(first + ops.arange(rows), columns, dtype=scores.dtype)
        scores, labels = self.hard_negative_mining(scores, labels)
        return self.loss_fn(labels, scores)


def two_tower_retrieval(env: Env, gathered: bool = False) -> Result:
    users, items, batch_size = 24, 30, 8
    rng = np.random.default_rng(707)
    user_id = rng.integers(0, users, size=(32,)).astype("int32")
    # Distinct items within a batch: a candidate twice in a batch is its row's positive
    # and a negative at once, whose gradients cancel up to rounding (see above).
    item_id = np.concatenate([rng.permutation(items)[:batch_size] for _ in range(4)])
    item_id = item_id.astype("int32")

    kc._fresh_start(77)
    with env.scope():
        model = TwoTowerRetrieval(users, items, gathered=gathered)
        model.compile(optimizer=keras.optimizers.Adam(learning_rate=0.05))
    node_x, node_batch = _node_rows(env, batch_size, {"user_id": user_id, "item_id": item_id})
    history, losses = _fit(model, node_x, batch_size=node_batch, epochs=2, shuffle=False)
    model.retrieval.update_candidates(model.candidate_tower(np.arange(items)))
    top = model.retrieval(model.query_tower(np.arange(4)))
    return kc.result(model, model.optimizer, history, losses, top_candidates=np.array(top))


# ----------------------------------------------------------------------------- (h) ranking

def listwise_pairwise_hinge(env: Env) -> Result:
    """A scorer applied to every item of a list, trained with PairwiseHingeLoss, NDCG tracked."""
    lists, list_size, features = 32, 5, 6
    rng = np.random.default_rng(708)
    x = rng.normal(size=(lists, list_size, features)).astype("float32")
    relevance = np.clip(np.round(x[..., 0] + 0.5 * x[..., 1] + 1.0), 0, 3).astype("float32")

    kc._fresh_start(78)
    with env.scope():
        inputs = keras.Input(shape=(list_size, features))
        hidden = layers.Dense(16, activation="relu")(inputs)
        # No bias: a pairwise loss sees score differences only, so a bias has no gradient.
        scores = layers.Reshape((list_size,))(layers.Dense(1, use_bias=False)(hidden))
        ranker = keras.Model(inputs, scores)
        ranker.compile(optimizer=keras.optimizers.Adam(1e-2),
                       loss=keras_rs.losses.PairwiseHingeLoss(),
                       metrics=[keras_rs.metrics.NDCG(k=3, name="ndcg")])
    history, losses = _fit(ranker, x, relevance, batch_size=8, epochs=2, shuffle=False)
    return kc.result(ranker, ranker.optimizer, history, losses)


SCRIPTS: Dict[str, Callable[[Env], Result]] = {
    "gpt2_causal_lm": gpt2_causal_lm,
    "bert_text_classifier": bert_text_classifier,
    "seq2seq_transformer": seq2seq_transformer,
    "resnet_image_classifier": resnet_image_classifier,
    "synchronized_bn_classifier": synchronized_bn_classifier,
    "dcn_feature_cross": dcn_feature_cross,
    "dlrm_dot_interaction": dlrm_dot_interaction,
    "two_tower_retrieval": two_tower_retrieval,
    "two_tower_retrieval_gathered": functools.partial(two_tower_retrieval, gathered=True),
    "listwise_pairwise_hinge": listwise_pairwise_hinge,
}
