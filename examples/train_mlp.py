"""Trains a small MLP regression model with AutoDist and prints loss and strategy.

Run from the repository root:
    python examples/train_mlp.py                       # PS on configs/local_2cpu.yml
    python examples/train_mlp.py --builder AllReduce --steps 50
"""
import argparse
import os

# Imported first, AutoDist keeps TensorFlow's C++ start-up logs quiet
# (AUTODIST_TF_LOGS=1 shows them).
from autodist import AutoDist
import numpy as np
import tensorflow as tf

from autodist.strategy import BUILDERS, Strategy, get_builder

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_SPEC = os.path.join(HERE, "..", "configs", "local_2cpu.yml")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default=DEFAULT_SPEC, help="resource spec YAML")
    parser.add_argument("--builder", default="PS", choices=sorted(BUILDERS),
                        help="strategy builder")
    parser.add_argument("--strategy", help="reuse a saved strategy file instead of a builder")
    parser.add_argument("--save-strategy", help="where to save the strategy used")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    args = parser.parse_args()

    rng = np.random.RandomState(0)
    true_w = rng.randn(16, 1).astype(np.float32)
    inputs = rng.randn(args.batch * 8, 16).astype(np.float32)
    targets = inputs @ true_w + 0.01 * rng.randn(len(inputs), 1).astype(np.float32)

    builder = Strategy.load(args.strategy) if args.strategy else get_builder(args.builder)
    ad = AutoDist(resource_spec_file=args.spec, strategy_builder=builder)
    with tf.Graph().as_default(), ad.scope():
        x = tf.compat.v1.placeholder(tf.float32, [None, 16], name="x")
        y = tf.compat.v1.placeholder(tf.float32, [None, 1], name="y")
        hidden = tf.keras.layers.Dense(32, activation="relu")(x)
        prediction = tf.keras.layers.Dense(1)(hidden)
        loss = tf.reduce_mean(tf.square(prediction - y))
        train_op = tf.compat.v1.train.AdamOptimizer(0.01).minimize(loss)

        sess = ad.create_distributed_session()
        for step in range(args.steps):
            start = (step * args.batch) % len(inputs)
            batch = slice(start, start + args.batch)
            value, _ = sess.run([loss, train_op], {x: inputs[batch], y: targets[batch]})
            print(f"step {step:3d}  loss {value:.4f}")

    print(f"\nStrategy {ad.strategy.id} ({args.builder if not args.strategy else args.strategy}):")
    print(ad.strategy)
    if args.save_strategy:
        print(f"saved to {ad.strategy.save(args.save_strategy)}")


if __name__ == "__main__":
    main()
