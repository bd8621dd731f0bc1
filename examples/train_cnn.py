"""Trains a small Keras 3 CNN classifier with ``model.fit`` through AutoDist.

The data are random 16x16x3 "images": each is one of 10 fixed random patterns
(its class) under heavy noise, so there is something to learn.

Run from the repository root:
    python3 examples/train_cnn.py                          # AllReduce on configs/local_2cpu.yml
    python3 examples/train_cnn.py --builder PartitionedPS --epochs 3
    # on an emulated cluster (see README, "Try it on one machine"):
    ip netns exec ad-h1 python3 examples/train_cnn.py --spec cluster.yml
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
NUM_CLASSES = 10


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
    patterns = rng.randn(NUM_CLASSES, 16, 16, 3).astype(np.float32)
    labels = rng.randint(NUM_CLASSES, size=args.batch * 16)
    images = patterns[labels] + 2.0 * rng.randn(len(labels), 16, 16, 3).astype(np.float32)

    builder = Strategy.load(args.strategy) if args.strategy else get_builder(args.builder)
    ad = AutoDist(resource_spec_file=args.spec, strategy_builder=builder)
    # Every node runs this script; each trains on its own shard with its share of the batch.
    num_nodes = len(ad.resource_spec.nodes)
    batch = args.batch // num_nodes
    images, labels = images[ad.node_index::num_nodes], labels[ad.node_index::num_nodes]

    with ad.scope():
        model = keras.Sequential([
            keras.Input(shape=(16, 16, 3)),
            keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(NUM_CLASSES),
        ])
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    model.fit(images, labels, batch_size=batch, epochs=args.epochs, verbose=2)

    print(f"\nStrategy {ad.strategy.id} ({args.strategy or args.builder}):")
    print(ad.strategy)
    if args.save_strategy:
        print(f"saved to {ad.strategy.save(args.save_strategy)}")


if __name__ == "__main__":
    main()
