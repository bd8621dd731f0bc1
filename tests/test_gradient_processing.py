"""Gradient processing between ``compute_gradients`` and ``apply_gradients`` runs once,
on the averaged gradients, as single-device training runs it on the batch's.

The 2-node cluster cases are in ``test_multinode.py``.
"""
import contextlib

import numpy as np
import pytest
import tensorflow as tf

import models
from autodist import AutoDist
from autodist.strategy import AllReduce, ShardedUpdateAR
from test_equivalence import BUILDERS

tf1 = tf.compat.v1

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

STEPS = 3
CLIP = 0.2  # below every model's gradient norm here (asserted): clipping binds
ATOL = RTOL = 1e-5


class ClippingAdam(tf1.train.AdamOptimizer):
    """Adam whose ``minimize`` clips the gradients by their global norm in between.

    Args:
        norms: receives the global norm tensor.
    """

    def __init__(self, norms: list = None):
        super().__init__(0.1)
        self.norms = [] if norms is None else norms

    def minimize(self, loss, global_step=None):
        grads, variables = zip(*self.compute_gradients(loss))
        clipped, norm = tf.clip_by_global_norm(grads, CLIP)
        self.norms.append(norm)
        return self.apply_gradients(zip(clipped, variables), global_step=global_step)


def open_session(ad):
    """AutoDist's session, or with ``ad`` None a plain one with the variables initialized."""
    if ad is not None:
        return ad.create_distributed_session()
    sess = tf1.Session()
    sess.run(tf1.global_variables_initializer())
    return sess


def train(model: str, ad=None, steps: int = STEPS):
    """(global norm per step, final variables), on one device or through ``ad``."""
    norms = []
    with tf.Graph().as_default(), (ad.scope() if ad else contextlib.nullcontext()):
        built = models.MODELS[model](lambda: ClippingAdam(norms))
        norm, = norms
        with open_session(ad) as sess:
            norms = [sess.run([norm, built.train_op], built.feeds)[0] for _ in range(steps)]
            return norms, sess.run([models.as_tf_variable(v) for v in built.variables])


@pytest.mark.parametrize("model", ["dense", "embedding", "partitionable"])
@pytest.mark.parametrize("builder", sorted(BUILDERS))
def test_clipping_by_global_norm_equals_one_device(spec_path, builder, model):
    want_norms, want = train(model)
    assert min(want_norms) > CLIP
    norms, got = train(model, AutoDist(spec_path, BUILDERS[builder]()))
    # The norm of the averaged gradient, computed once: not a mean of per-replica norms.
    np.testing.assert_allclose(norms, want_norms, rtol=RTOL, atol=ATOL)
    for index, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=f"variable #{index}")


def test_clipping_runs_on_the_mean_of_accumulated_gradients(spec_path):
    def run(ad, feeds_per_run):
        with tf.Graph().as_default(), (ad.scope() if ad else contextlib.nullcontext()):
            built = models.dense_mlp(ClippingAdam)
            with open_session(ad) as sess:
                for scale in feeds_per_run:
                    sess.run(built.train_op, {p: np.concatenate([v * s for s in scale])
                                              for p, v in built.feeds.items()})
                return sess.run([models.as_tf_variable(v) for v in built.variables])

    want = run(None, [(1.0, 0.5), (0.25, 2.0)])  # two steps on two batches each
    got = run(AutoDist(spec_path, AllReduce(), accumulation_steps=2),
              [(1.0,), (0.5,), (0.25,), (2.0,)])
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)


def test_processing_may_read_values_every_replica_shares(spec_path):
    def run(ad):
        with tf.Graph().as_default(), (ad.scope() if ad else contextlib.nullcontext()):
            scale = tf1.placeholder(tf.float32, [], name="scale")  # fed whole

            class ScalingSGD(tf1.train.GradientDescentOptimizer):
                def minimize(self, loss, global_step=None):
                    pairs = self.compute_gradients(loss)
                    return self.apply_gradients([(g * scale, v) for g, v in pairs])

            built = models.dense_mlp(lambda: ScalingSGD(0.1))
            with open_session(ad) as sess:
                for value in (1.0, 3.0):
                    sess.run(built.train_op, {**built.feeds, scale: value})
                return sess.run([models.as_tf_variable(v) for v in built.variables])

    for g, w in zip(run(AutoDist(spec_path, AllReduce())), run(None)):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)


def test_processing_reading_a_per_replica_tensor_is_refused_by_name(spec_path):
    class LossScaledSGD(tf1.train.GradientDescentOptimizer):
        def minimize(self, loss, global_step=None):
            pairs = self.compute_gradients(loss)
            return self.apply_gradients([(g * loss, v) for g, v in pairs])

    ad = AutoDist(spec_path, AllReduce())
    with tf.Graph().as_default(), ad.scope():
        built = models.dense_mlp(lambda: LossScaledSGD(0.1))
        with pytest.raises(ValueError, match=f"reads '{built.loss.name}', which each replica "
                                             "computes from its own rows"):
            ad.create_distributed_session()


def test_processing_of_sharded_updates_is_refused(spec_path):
    ad = AutoDist(spec_path, ShardedUpdateAR())
    with tf.Graph().as_default(), ad.scope():
        models.dense_mlp(ClippingAdam)
        with pytest.raises(ValueError, match="the strategy updates them in shards"):
            ad.create_distributed_session()
