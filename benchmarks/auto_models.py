"""The training scripts `auto_vs_builders.py` searches and times: three models, three trade-offs.

    python benchmarks/auto_models.py --model embedding --spec SPEC [--builder B | --strategy F]

* ``embedding``: one large embedding table (sparse gradient) feeding dense layers;
* ``bert``: a small BERT-like encoder: many variables of mixed sizes (about 200);
* ``mlp``: a few large dense matrices.

Each node feeds its own random batch (``--batch`` rows per replica); the script
trains ``--steps`` steps and prints the mean step time of the second half.
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf1 = tf.compat.v1

VOCAB = 100_000
EMBEDDING_DIM = 64
BERT_LAYERS, BERT_HIDDEN, BERT_FFN, BERT_VOCAB, BERT_TOKENS = 12, 256, 1024, 8000, 16
MLP_WIDTH, MLP_LAYERS = 2048, 3


def _weight(name: str, shape, seed: int) -> tf.Variable:
    return tf1.get_variable(name, shape, use_resource=True,
                            initializer=tf1.random_normal_initializer(stddev=0.02, seed=seed))


def _zeros(name: str, shape) -> tf.Variable:
    return tf1.get_variable(name, shape, use_resource=True, initializer=tf1.zeros_initializer())


def embedding_model(rng: np.random.RandomState, rows: int):
    """A 100k x 64 table looked up by 16 ids per example, then a 64-1024-1024-1 MLP."""
    ids = tf1.placeholder(tf.int32, [None, 16], name="ids")
    y = tf1.placeholder(tf.float32, [None, 1], name="y")
    table = _weight("embedding", [VOCAB, EMBEDDING_DIM], 1)
    hidden = tf.reduce_mean(tf.gather(table, ids), axis=1)
    for i, width in enumerate([1024, 1024]):
        w = _weight(f"dense{i}/w", [hidden.shape[1], width], 10 + i)
        hidden = tf.nn.relu(tf.matmul(hidden, w) + _zeros(f"dense{i}/b", [width]))
    out = tf.matmul(hidden, _weight("out/w", [1024, 1], 20))
    loss = tf.reduce_mean(tf.square(out - y))
    # Zipf-like ids: a few rows are hot, as in real vocabularies.
    feeds = {ids: np.minimum(rng.zipf(1.2, size=(rows, 16)), VOCAB) - 1,
             y: rng.randn(rows, 1).astype(np.float32)}
    return loss, feeds


def bert_model(rng: np.random.RandomState, rows: int):
    """Token embeddings, then layers of self-attention and feed-forward with layer norms."""
    tokens = tf1.placeholder(tf.int32, [None, BERT_TOKENS], name="tokens")
    y = tf1.placeholder(tf.float32, [None, 1], name="y")
    h = tf.gather(_weight("embeddings/word", [BERT_VOCAB, BERT_HIDDEN], 1), tokens)
    h = h + _weight("embeddings/position", [BERT_TOKENS, BERT_HIDDEN], 2)
    flat = tf.reshape(h, [-1, BERT_HIDDEN])

    def dense(x, name, width, seed):
        return tf.matmul(x, _weight(f"{name}/w", [x.shape[1], width], seed)) + _zeros(
            f"{name}/b", [width])

    def layer_norm(x, name):
        mean, variance = tf.nn.moments(x, [1], keepdims=True)
        gamma = tf1.get_variable(f"{name}/gamma", [BERT_HIDDEN], use_resource=True,
                                 initializer=tf1.ones_initializer())
        return (x - mean) * tf.math.rsqrt(variance + 1e-6) * gamma + _zeros(f"{name}/beta",
                                                                          [BERT_HIDDEN])

    for i in range(BERT_LAYERS):
        seed = 100 * (i + 1)
        q, k, v = (tf.reshape(dense(flat, f"layer{i}/{n}", BERT_HIDDEN, seed + j),
                              [-1, BERT_TOKENS, BERT_HIDDEN]) for j, n in enumerate("qkv"))
        attention = tf.nn.softmax(tf.matmul(q, k, transpose_b=True) / 16.0)
        context = tf.reshape(tf.matmul(attention, v), [-1, BERT_HIDDEN])
        flat = layer_norm(flat + dense(context, f"layer{i}/attention_out", BERT_HIDDEN, seed + 3),
                          f"layer{i}/ln1")
        ffn = dense(tf.nn.gelu(dense(flat, f"layer{i}/ffn_in", BERT_FFN, seed + 4)),
                    f"layer{i}/ffn_out", BERT_HIDDEN, seed + 5)
        flat = layer_norm(flat + ffn, f"layer{i}/ln2")
    pooled = tf.reduce_mean(tf.reshape(flat, [-1, BERT_TOKENS, BERT_HIDDEN]), axis=1)
    loss = tf.reduce_mean(tf.square(dense(pooled, "head", 1, 7) - y))
    feeds = {tokens: rng.randint(0, BERT_VOCAB, size=(rows, BERT_TOKENS)),
             y: rng.randn(rows, 1).astype(np.float32)}
    return loss, feeds


def mlp_model(rng: np.random.RandomState, rows: int):
    """Three 2048 x 2048 matrices (16 MB each) and a small head."""
    x = tf1.placeholder(tf.float32, [None, MLP_WIDTH], name="x")
    y = tf1.placeholder(tf.float32, [None, 1], name="y")
    hidden = x
    for i in range(MLP_LAYERS):
        hidden = tf.tanh(tf.matmul(hidden, _weight(f"layer{i}/w", [MLP_WIDTH, MLP_WIDTH], i + 1)))
    loss = tf.reduce_mean(tf.square(tf.matmul(hidden, _weight("head/w", [MLP_WIDTH, 1], 9)) - y))
    feeds = {x: rng.randn(rows, MLP_WIDTH).astype(np.float32),
             y: rng.randn(rows, 1).astype(np.float32)}
    return loss, feeds


MODELS = {"embedding": embedding_model, "bert": bert_model, "mlp": mlp_model}


def main() -> None:
    from autodist import AutoDist
    from autodist.strategy import Strategy, get_builder

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--spec", required=True)
    parser.add_argument("--builder", default="PS")
    parser.add_argument("--strategy", help="a saved strategy instead of --builder")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16, help="rows per replica")
    args = parser.parse_args()

    builder = Strategy.load(args.strategy) if args.strategy else get_builder(args.builder)
    ad = AutoDist(args.spec, builder)
    node = ad.resource_spec.node(ad.resource_spec.node_addresses[ad.node_index])
    rng = np.random.RandomState(ad.node_index)
    with tf.Graph().as_default(), ad.scope():
        tf1.set_random_seed(0)
        loss, feeds = MODELS[args.model](rng, args.batch * len(node.cpus))
        train_op = tf1.train.GradientDescentOptimizer(0.01).minimize(loss)
        sess = ad.create_distributed_session()
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            sess.run(train_op, feeds)
            times.append(time.perf_counter() - start)
    if ad.is_chief:
        second_half = times[len(times) // 2:]
        print(f"mean step time {np.mean(second_half):.4f} s over {len(second_half)} steps")


if __name__ == "__main__":
    main()
