"""Saves two checkpoints of a small PS model; the crash-safety test kills it mid-save.

    python checkpoint_save_job.py DIRECTORY

Writes DIRECTORY/model-1 (after one step) then DIRECTORY/model-2 (after two).
"""
import sys

import autodist  # noqa: F401 - first, so TensorFlow loads quietly
import numpy as np
import tensorflow as tf

from autodist import AutoDist
from autodist.checkpoint import Saver
from autodist.strategy import PartitionedPS

SPEC = sys.argv[2] if len(sys.argv) > 2 else "configs/local_2cpu.yml"


def build(dtype=tf.float32):
    """The model: returns (x, train op, [variables])."""
    x = tf.compat.v1.placeholder(dtype, [None, 8], name="x")
    table = tf.compat.v1.get_variable("table", [4000, 256], dtype,
                                      initializer=tf.ones_initializer(), use_resource=True)
    w = tf.compat.v1.get_variable("w", [8, 256], dtype, initializer=tf.ones_initializer(),
                                  use_resource=True)
    loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - tf.reduce_mean(table)))
    train = tf.compat.v1.train.AdamOptimizer(0.1).minimize(loss)
    return x, train, [table, w]


def main() -> None:
    directory = sys.argv[1]
    ad = AutoDist(SPEC, PartitionedPS())
    with tf.Graph().as_default(), ad.scope():
        x, train, _ = build()
        saver = Saver(max_to_keep=5)
        sess = ad.create_distributed_session()
        batch = np.ones((4, 8), np.float32)
        for step in (1, 2):
            sess.run(train, {x: batch})
            print(f"saving {step}", flush=True)
            saver.save(sess, f"{directory}/model", global_step=step)
            print(f"saved {step}", flush=True)


if __name__ == "__main__":
    main()
