"""Trains a Keras 3 wide-and-deep recommender with ``model.fit`` through AutoDist.

The deep part embeds an item id (a large 20000-row table) and a user group id
(a small table) and feeds them, with dense context features, to an MLP; the
wide part is linear in the item id and the context features. The default
builder, Parallax, puts the embeddings (sparse gradients) on partitioned
parameter servers and all-reduces the dense weights. Clicks are drawn from a
hidden logistic model.

Run from the repository root:
    python3 examples/train_wide_deep.py                    # Parallax on configs/local_2cpu.yml
    python3 examples/train_wide_deep.py --builder PartitionedPS --epochs 3
    # on an emulated cluster (see README, "Try it on one machine"):
    ip netns exec ad-h1 python3 examples/train_wide_deep.py --spec cluster.yml
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
NUM_ITEMS, NUM_GROUPS, NUM_CONTEXT = 20000, 50, 8


def build_model() -> keras.Model:
    """Wide (linear) and deep (embeddings + MLP) logits, summed into a click probability."""
    item = keras.Input(shape=(), dtype="int32", name="item")
    group = keras.Input(shape=(), dtype="int32", name="group")
    context = keras.Input(shape=(NUM_CONTEXT,), name="context")
    deep = keras.layers.Concatenate()([keras.layers.Embedding(NUM_ITEMS, 16)(item),
                                       keras.layers.Embedding(NUM_GROUPS, 4)(group), context])
    deep = keras.layers.Dense(64, activation="relu")(deep)
    deep = keras.layers.Dense(32, activation="relu")(deep)
    # A one-column embedding is a linear model over one-hot item ids, without the one-hots.
    wide_item = keras.layers.Flatten()(keras.layers.Embedding(NUM_ITEMS, 1)(item))
    logit = keras.layers.Dense(1)(keras.layers.Concatenate()([deep, wide_item, context]))
    click = keras.layers.Activation("sigmoid")(logit)
    return keras.Model({"item": item, "group": group, "context": context}, click)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default=DEFAULT_SPEC, help="resource spec YAML")
    parser.add_argument("--builder", default="Parallax", choices=sorted(BUILDERS),
                        help="strategy builder")
    parser.add_argument("--strategy", help="reuse a saved strategy file instead of a builder")
    parser.add_argument("--save-strategy", help="where to save the strategy used")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=256,
                        help="global batch size (all nodes together)")
    args = parser.parse_args()
    # The same initial weights and shuffling in every run, so that builders can be compared.
    keras.utils.set_random_seed(0)

    rng = np.random.RandomState(0)
    rows = args.batch * 16
    # A few popular items and a long tail, as in real click logs.
    items = (rng.zipf(1.3, rows) % NUM_ITEMS).astype(np.int32)
    groups = rng.randint(NUM_GROUPS, size=rows).astype(np.int32)
    context = rng.randn(rows, NUM_CONTEXT).astype(np.float32)
    logit = (2 * rng.randn(NUM_ITEMS)[items] + rng.randn(NUM_GROUPS)[groups]
             + context @ rng.randn(NUM_CONTEXT))
    clicks = (rng.rand(rows) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    features = {"item": items, "group": groups, "context": context}

    builder = Strategy.load(args.strategy) if args.strategy else get_builder(args.builder)
    ad = AutoDist(resource_spec_file=args.spec, strategy_builder=builder)
    # Every node runs this script; each trains on its own shard with its share of the batch.
    num_nodes = len(ad.resource_spec.nodes)
    batch = args.batch // num_nodes
    features = {name: value[ad.node_index::num_nodes] for name, value in features.items()}
    clicks = clicks[ad.node_index::num_nodes]

    with ad.scope():
        model = build_model()
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="binary_crossentropy",
                      metrics=["accuracy"])
    model.fit(features, clicks, batch_size=batch, epochs=args.epochs, verbose=2)

    print(f"\nStrategy {ad.strategy.id} ({args.strategy or args.builder}):")
    print(ad.strategy)
    if args.save_strategy:
        print(f"saved to {ad.strategy.save(args.save_strategy)}")


if __name__ == "__main__":
    main()
