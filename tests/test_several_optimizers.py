"""Several optimizer updates in one graph: each ``apply_gradients`` call is synchronized
and applied on its own, whether the graph runs them in separate train ops (a GAN)
or in one. The 2-node cluster case is in ``test_multinode.py``.
"""
import numpy as np
import pytest
import tensorflow as tf

import models
from autodist import AutoDist
from autodist.strategy import AllReduce, PartitionedPS
from test_equivalence import WITH_SHARDED_UPDATE as BUILDERS

tf1 = tf.compat.v1

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

ROUNDS = 3
ATOL = RTOL = 1e-5


def adam():
    return tf1.train.AdamOptimizer(0.05)


def gan_single(rounds: int = ROUNDS, optimizer_fn=adam) -> dict:
    """Every global variable after alternating discriminator and generator steps on one device."""
    with tf.Graph().as_default():
        gan = models.gan(optimizer_fn)
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            for _ in range(rounds):
                sess.run(gan.d_train, gan.feeds)
                sess.run(gan.g_train, gan.feeds)
            return {v.op.name: sess.run(v) for v in tf1.global_variables()}


@pytest.mark.parametrize("builder", sorted(BUILDERS))
def test_a_gan_trained_in_two_train_ops_equals_one_device(spec_path, builder):
    want = gan_single()
    ad = AutoDist(spec_path, BUILDERS[builder]())
    with tf.Graph().as_default(), ad.scope():
        gan = models.gan(adam)
        variables = tf1.global_variables()
        with ad.create_distributed_session() as sess:
            assert len(sess.distributed.updates) == 2
            for _ in range(ROUNDS):
                sess.run(gan.d_train, gan.feeds)
                sess.run(gan.g_train, gan.feeds)
            got = dict(zip([v.op.name for v in variables], sess.run(variables)))
    # Both Adams' slots and powers (beta1_power and beta1_power_1) are their own.
    assert set(got) == set(want)
    assert {"beta1_power", "beta1_power_1", "global_step"} <= set(got)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=RTOL, atol=ATOL, err_msg=name)


def test_each_train_op_updates_only_its_own_variables(spec_path):
    ad = AutoDist(spec_path, AllReduce())
    with tf.Graph().as_default(), ad.scope():
        gan = models.gan(adam)
        generator, discriminator = gan.variables[:2], gan.variables[2:]
        with ad.create_distributed_session() as sess:
            before = sess.run(gan.variables)
            sess.run(gan.d_train, gan.feeds)
            after_d = sess.run(gan.variables)
            sess.run(gan.g_train, gan.feeds)
            after_g = sess.run(gan.variables)
    for i in range(len(generator)):
        np.testing.assert_array_equal(after_d[i], before[i])     # d_train left G alone
        assert not np.array_equal(after_g[i], after_d[i])        # g_train moved it
    for i in range(len(generator), len(generator) + len(discriminator)):
        assert not np.array_equal(after_d[i], before[i])
        np.testing.assert_array_equal(after_g[i], after_d[i])


def test_two_optimizers_in_one_train_op_equal_one_device(spec_path):
    def build():
        tf1.set_random_seed(0)
        ids = tf1.placeholder(tf.int32, [None], name="ids")
        y = tf1.placeholder(tf.float32, [None, 3], name="y")
        table = tf1.get_variable("embedding", [models.EMBEDDING_ROWS, 8], use_resource=True,
                                 initializer=tf1.random_normal_initializer(seed=1))
        dense = tf1.get_variable("w", [8, 3], use_resource=True,
                                 initializer=tf1.random_normal_initializer(seed=2))
        loss = tf.reduce_mean(tf.square(tf.matmul(tf.tanh(tf.gather(table, ids)), dense) - y))
        table_grad, dense_grad = tf.gradients(loss, [table, dense])
        train = tf.group(tf1.train.AdagradOptimizer(0.2).apply_gradients([(table_grad, table)]),
                         tf1.train.AdamOptimizer(0.05).apply_gradients([(dense_grad, dense)]))
        feeds = {ids: models.EMBEDDING_IDS.copy(),
                 y: np.random.RandomState(0).randn(models.BATCH_SIZE, 3).astype(np.float32)}
        return train, feeds, [table, dense]

    with tf.Graph().as_default():
        train, feeds, variables = build()
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            for _ in range(ROUNDS):
                sess.run(train, feeds)
            want = sess.run(variables)
    ad = AutoDist(spec_path, PartitionedPS())
    with tf.Graph().as_default(), ad.scope():
        train, feeds, variables = build()
        with ad.create_distributed_session() as sess:
            for _ in range(ROUNDS):
                sess.run(train, feeds)
            got = sess.run(variables)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)


def test_a_variable_updated_by_two_optimizers_is_refused_by_name(spec_path):
    ad = AutoDist(spec_path, AllReduce())
    with tf.Graph().as_default(), ad.scope():
        built = models.dense_mlp(adam)  # one Adam updates every variable
        tf1.train.GradientDescentOptimizer(0.1).minimize(built.loss, var_list=built.variables[:1])
        with pytest.raises(ValueError, match=r"variable 'w1' is updated by two optimizer calls "
                                             r"\(apply_gradients #1 and #2\)"):
            ad.create_distributed_session()


def test_gan_with_accumulation_counts_each_train_op_s_runs(spec_path):
    # Each train op accumulates over its own runs: d and g each update every 2 of theirs.
    with tf.Graph().as_default():
        gan = models.gan(adam)
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            doubled = {p: np.concatenate([v, v * 0.5]) for p, v in gan.feeds.items()}
            sess.run(gan.d_train, doubled)
            sess.run(gan.g_train, doubled)
            want = sess.run(gan.variables)
    ad = AutoDist(spec_path, AllReduce(), accumulation_steps=2)
    with tf.Graph().as_default(), ad.scope():
        gan = models.gan(adam)
        halves = [gan.feeds, {p: v * 0.5 for p, v in gan.feeds.items()}]
        with ad.create_distributed_session() as sess:
            for feeds in halves:
                sess.run(gan.d_train, feeds)
            for feeds in halves:
                sess.run(gan.g_train, feeds)
            got = sess.run(gan.variables)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)
