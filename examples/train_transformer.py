"""Trains a small Keras 3 transformer encoder classifier with ``model.fit`` through AutoDist.

The data are random token sequences (vocabulary 200, length 16); a sequence is
positive when most of its tokens come from the lower half of the vocabulary.

Run from the repository root:
    python3 examples/train_transformer.py                  # AllReduce on configs/local_2cpu.yml
    python3 examples/train_transformer.py --builder Parallax --epochs 3
    # on an emulated cluster (see README, "Try it on one machine"):
    ip netns exec ad-h1 python3 examples/train_transformer.py --spec cluster.yml
"""
import argparse
import os

# Imported first, AutoDist keeps TensorFlow's C++ start-up logs quiet
# (AUTODIST_TF_LOGS=1 shows them).
from autodist import AutoDist
import keras
import numpy as np

from autodist.strategy import BUILDERS, Strategy, get_builder

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_SPEC = os.path.join(HERE, "..", "configs", "local_2cpu.yml")
VOCAB, LENGTH, DIM = 200, 16, 32


class TokenAndPositionEmbedding(keras.layers.Layer):
    """Embeds each token and adds a learned embedding of its position."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tokens = keras.layers.Embedding(VOCAB, DIM)
        self.positions = keras.layers.Embedding(LENGTH, DIM)

    def call(self, ids):
        return self.tokens(ids) + self.positions(keras.ops.arange(keras.ops.shape(ids)[-1]))


def build_model() -> keras.Model:
    """One encoder block (attention and feed-forward, each residual + LayerNorm) and a head."""
    ids = keras.Input(shape=(LENGTH,), dtype="int32")
    x = TokenAndPositionEmbedding()(ids)
    attended = keras.layers.MultiHeadAttention(num_heads=2, key_dim=DIM // 2)(x, x)
    x = keras.layers.LayerNormalization()(x + attended)
    hidden = keras.layers.Dense(2 * DIM, activation="relu")(x)
    hidden = keras.layers.Dropout(0.1)(keras.layers.Dense(DIM)(hidden))
    x = keras.layers.LayerNormalization()(x + hidden)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(ids, keras.layers.Dense(1, activation="sigmoid")(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default=DEFAULT_SPEC, help="resource spec YAML")
    parser.add_argument("--builder", default="AllReduce", choices=sorted(BUILDERS),
                        help="strategy builder")
    parser.add_argument("--strategy", help="reuse a saved strategy file instead of a builder")
    parser.add_argument("--save-strategy", help="where to save the strategy used")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64,
                        help="global batch size (all nodes together)")
    args = parser.parse_args()
    # The same initial weights and shuffling in every run, so that builders can be compared.
    keras.utils.set_random_seed(0)

    rng = np.random.RandomState(0)
    tokens = rng.randint(VOCAB, size=(args.batch * 16, LENGTH)).astype(np.int32)
    labels = (np.sum(tokens < VOCAB // 2, axis=1) > LENGTH // 2).astype(np.float32)

    builder = Strategy.load(args.strategy) if args.strategy else get_builder(args.builder)
    ad = AutoDist(resource_spec_file=args.spec, strategy_builder=builder)
    # Every node runs this script; each trains on its own shard with its share of the batch.
    num_nodes = len(ad.resource_spec.nodes)
    batch = args.batch // num_nodes
    tokens, labels = tokens[ad.node_index::num_nodes], labels[ad.node_index::num_nodes]

    with ad.scope():
        model = build_model()
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="binary_crossentropy",
                      metrics=["accuracy"])
    model.fit(tokens, labels, batch_size=batch, epochs=args.epochs, verbose=2)

    print(f"\nStrategy {ad.strategy.id} ({args.strategy or args.builder}):")
    print(ad.strategy)
    if args.save_strategy:
        print(f"saved to {ad.strategy.save(args.save_strategy)}")


if __name__ == "__main__":
    main()
