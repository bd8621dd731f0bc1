"""Zero-started state costs its size once: Grappler may not fold a large fill into a
constant that the session keeps (``kernels/fills.py``)."""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from autodist.kernels import fills
from test_initial_rows import run_memory_job

tf1 = tf.compat.v1


def test_large_fills_read_their_value_through_a_placeholder_with_default():
    graph = tf.Graph()
    with graph.as_default():
        large = tf.fill([fills.KEPT_FILL_BYTES // 4, 2], 3.0)
        small = tf.zeros([16, 16])
        unknown = tf.fill(tf1.placeholder(tf.int32, [2]), 1.0)
    assert fills.keep_large_fills(graph) == 1
    assert large.op.inputs[1].op.type == "PlaceholderWithDefault"
    assert small.op.type == "Const" or small.op.inputs[1].op.type == "Const"
    assert unknown.op.inputs[1].op.type == "Const"
    assert fills.keep_large_fills(graph) == 0  # done once
    with tf1.Session(graph=graph) as session:
        value = session.run(large)
    assert value.shape == (fills.KEPT_FILL_BYTES // 4, 2) and np.all(value == 3.0)


_ZERO_STARTED_JOB = """
import sys
import numpy as np
import tensorflow as tf
from autodist import AutoDist
from autodist.strategy import AllReduce
tf1 = tf.compat.v1

def resident_gib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2 ** 30

ad = AutoDist(sys.argv[1], AllReduce())
with tf.Graph().as_default(), ad.scope():
    weights = tf1.get_variable("weights", [ROWS, 64], use_resource=True,
                               initializer=tf1.zeros_initializer())
    loss = tf.reduce_sum(tf.square(weights - 1.0))
    train = tf1.train.AdamOptimizer(0.01).minimize(loss)
    before = resident_gib()
    sess = ad.create_distributed_session()
    for _ in range(3):
        sess.run(train)
    print("GROWTH", resident_gib() - before)
    print("VALUE", float(sess.run(weights)[0, 0]))
"""


def test_zero_started_variables_and_slots_are_held_once(spec_path, tmp_path):
    """A variable and Adam's two slots, all started at zeros, hold three copies after
    training; each zero start kept as a constant made that six."""
    rows = 2 ** 20  # 256 MiB of float32
    printed = run_memory_job(_ZERO_STARTED_JOB.replace("ROWS", str(rows)), tmp_path, spec_path,
                             timeout=240)
    copy_gib = rows * 64 * 4 / 2 ** 30
    assert 2.7 * copy_gib < printed["GROWTH"] < 3.6 * copy_gib, (printed["GROWTH"] / copy_gib,
                                                                  "copies")
    # Trained: three of Adam's steps of about the learning rate each, towards 1.
    np.testing.assert_allclose(printed["VALUE"], 0.03, rtol=1e-3)
