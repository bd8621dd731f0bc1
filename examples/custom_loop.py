"""Trains a Keras 3 MLP regression with a custom GradientTape loop and ``@ad.function``.

The training step is the usual single-device TF2 code; ``ad.function`` runs it
data-parallel: each call takes the global batch, splits it across the replicas
and returns the loss as the replicas' mean.

Run from the repository root:
    python3 examples/custom_loop.py                        # AllReduce on configs/local_2cpu.yml
    python3 examples/custom_loop.py --builder PartitionedPS --steps 50
    # on an emulated cluster (see README, "Try it on one machine"):
    ip netns exec ad-h1 python3 examples/custom_loop.py --spec cluster.yml
"""
import argparse
import os

# Imported first, AutoDist keeps TensorFlow's C++ start-up logs quiet
# (AUTODIST_TF_LOGS=1 shows them).
from autodist import AutoDist
import keras
import numpy as np
import tensorflow as tf

from autodist.strategy import BUILDERS, Strategy, get_builder

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_SPEC = os.path.join(HERE, "..", "configs", "local_2cpu.yml")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default=DEFAULT_SPEC, help="resource spec YAML")
    parser.add_argument("--builder", default="AllReduce", choices=sorted(BUILDERS),
                        help="strategy builder")
    parser.add_argument("--strategy", help="reuse a saved strategy file instead of a builder")
    parser.add_argument("--save-strategy", help="where to save the strategy used")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64,
                        help="global batch size (all nodes together)")
    args = parser.parse_args()
    # The same initial weights in every run, so that builders can be compared.
    keras.utils.set_random_seed(0)

    rng = np.random.RandomState(0)
    true_w = rng.randn(16, 1).astype(np.float32)
    inputs = rng.randn(args.batch * 8, 16).astype(np.float32)
    targets = inputs @ true_w + 0.01 * rng.randn(len(inputs), 1).astype(np.float32)

    builder = Strategy.load(args.strategy) if args.strategy else get_builder(args.builder)
    ad = AutoDist(resource_spec_file=args.spec, strategy_builder=builder)
    # Every node runs this script; each trains on its own shard with its share of the batch.
    num_nodes = len(ad.resource_spec.nodes)
    batch = args.batch // num_nodes
    inputs, targets = inputs[ad.node_index::num_nodes], targets[ad.node_index::num_nodes]

    with ad.scope():
        model = keras.Sequential([
            keras.Input(shape=(16,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(1),
        ])
        optimizer = keras.optimizers.Adam(1e-2)

    @ad.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    for step in range(args.steps):
        start = (step * batch) % len(inputs)
        loss = train_step(inputs[start:start + batch], targets[start:start + batch])
        print(f"step {step:3d}  loss {float(loss):.4f}")

    print(f"\nStrategy {ad.strategy.id} ({args.strategy or args.builder}):")
    print(ad.strategy)
    if args.save_strategy:
        print(f"saved to {ad.strategy.save(args.save_strategy)}")


if __name__ == "__main__":
    main()
