"""Scripts written for the original AutoDist (petuum/autodist): what they do either works
as it did there, or is refused by name before anything runs (issue 56, item 6)."""
import importlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_models as km
import models
from autodist import AutoDist, strategy
from autodist.keras.step import StepCache

tf1 = tf.compat.v1

pytestmark = pytest.mark.timeout(240)

SGD = lambda: tf1.train.GradientDescentOptimizer(0.1)  # noqa: E731


# ----------------------------------------------------------------------------- @ad.function on a method

def _trainer_class(decorate):
    """A trainer holding a Keras model, its step a method decorated by ``decorate``."""

    class Trainer:
        def __init__(self, seed: int = 0):
            self.model = km.build("mlp", seed)
            self.optimizer = keras.optimizers.Adam(1e-2)
            self.loss_fn = km.loss("mlp")
            self.loss_tracker = keras.metrics.Mean(name="loss_tracker")

        @decorate
        def train_step(self, x, y):
            with tf.GradientTape() as tape:
                loss = self.loss_fn(y, self.model(x, training=True))
            grads = tape.gradient(loss, self.model.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
            self.loss_tracker.update_state(loss)
            return loss

    return Trainer


def _train(trainer, epochs: int = 2) -> list:
    x, y = km.data("mlp")
    losses = []
    for _ in range(epochs):
        for start in range(0, km.SAMPLES, km.BATCH_SIZE):
            batch = slice(start, start + km.BATCH_SIZE)
            losses.append(float(trainer.train_step(x[batch], y=y[batch])))
    return losses


@pytest.mark.slow
def test_ad_function_on_a_method_binds_self_and_trains_as_tf_function(spec_path):
    want_trainer = _trainer_class(tf.function)()
    want = _train(want_trainer)

    ad = AutoDist(spec_path, strategy.PS())
    Trainer = _trainer_class(ad.function)
    with ad.scope():
        trainer = Trainer()
    got = _train(trainer)

    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    for mine, theirs in zip(trainer.model.get_weights(), want_trainer.model.get_weights()):
        np.testing.assert_allclose(mine, theirs, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(float(trainer.loss_tracker.result()),
                               float(want_trainer.loss_tracker.result()), rtol=1e-6)
    # One distributed function per instance, kept: the class's own is not called.
    assert trainer.train_step is trainer.train_step
    assert Trainer.train_step is not trainer.train_step
    assert Trainer.train_step.step is None


@pytest.mark.slow
def test_two_instances_get_distributed_functions_of_their_own(spec_path):
    ad = AutoDist(spec_path, strategy.AllReduce())
    Trainer = _trainer_class(ad.function)
    with ad.scope():
        first, second = Trainer(seed=0), Trainer(seed=1)
    x, y = km.data("mlp")
    first.train_step(x[:8], y[:8])
    second_before = second.model.get_weights()
    first.train_step(x[8:16], y[8:16])
    assert first.train_step is not second.train_step
    for kept, now in zip(second_before, second.model.get_weights()):
        np.testing.assert_array_equal(kept, now)  # training first left second alone
    assert second.train_step.step is None


def test_ad_function_on_a_class_without_dict_names_the_fix(spec_path):
    ad = AutoDist(spec_path, strategy.PS())

    class Slotted:
        __slots__ = ()

        @ad.function
        def train_step(self, x):
            return x

    with pytest.raises(TypeError, match=r"Slotted\.train_step.*__slots__"):
        Slotted().train_step  # pylint: disable=expression-not-assigned


# ----------------------------------------------------------------------------- unknown batch sizes

def _shape_dependent_step():
    """A step computing with ``x.shape[0]``, which a free batch dimension makes None."""
    model = km.build("mlp")
    optimizer = keras.optimizers.SGD(0.1)

    def rows_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(x) - y)) / x.shape[0]
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return rows_step


def test_a_batch_of_unknown_size_is_refused_naming_the_step_and_the_fix():
    step = _shape_dependent_step()
    cache = StepCache(step, 2, open_step=lambda lifted: lifted)
    with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, [None, 6])
        y = tf1.placeholder(tf.float32, [None, 3])
        with pytest.raises(ValueError, match=r"rows_step.*batch size of its arguments is "
                                             r"unknown.*tf\.shape\(x\)\[0\]") as caught:
            cache.add((x, y))
    assert "for x, y in dataset: rows_step(x, y)" in str(caught.value)


@pytest.mark.parametrize("as_iterator", [False, True], ids=["dataset", "iterator"])
def test_a_tf_data_pipeline_passed_to_ad_function_is_refused_naming_the_step(spec_path,
                                                                             as_iterator):
    ad = AutoDist(spec_path, strategy.PS())
    with ad.scope():
        step = ad.function(_shape_dependent_step())
    x, y = km.data("mlp")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(km.BATCH_SIZE)
    with pytest.raises(ValueError, match=r"rows_step was passed a tf\.data dataset or iterator"
                                         r".*for x, y in dataset: rows_step\(x, y\)"):
        step(iter(dataset) if as_iterator else dataset)


# ----------------------------------------------------------------------------- control flow v1

@pytest.fixture
def control_flow_v1():
    """``tf.compat.v1`` graphs built with control flow v1 (Enter/Exit loops), restored after."""
    tf1.disable_control_flow_v2()
    try:
        yield
    finally:
        tf1.enable_control_flow_v2()
    assert tf1.control_flow_v2_enabled()


def _loop_ops(graph: tf.Graph) -> set:
    return {op.type for op in graph.get_operations()} & {"Enter", "Exit", "NextIteration"}


@pytest.mark.parametrize("builder", ["PS", "AllReduce"])
def test_a_control_flow_v1_loop_on_several_replicas_is_refused_by_name(spec_path,
                                                                      control_flow_v1, builder):
    """Today's failure was TensorFlow's "Invalid loop structure ... internal bug" at the
    first run; AutoDist now names the loop's op and the fix while it builds the session."""
    ad = AutoDist(spec_path, strategy.BUILDERS[builder]())
    with tf.Graph().as_default() as graph, ad.scope():
        models.rnn(SGD)
        assert _loop_ops(graph) == {"Enter", "Exit", "NextIteration"}
        enters = {op.name for op in graph.get_operations() if op.type == "Enter"}
        with pytest.raises(NotImplementedError,
                           match=r"tf\.compat\.v1 loop .* onto 2 replicas.*Enter op "
                                 r".*tf\.compat\.v1\.enable_control_flow_v2\(\)") as caught:
            ad.create_distributed_session()
    named = caught.value.args[0].split("Enter op '")[1].split("'")[0]
    assert named in enters


# ----------------------------------------------------------------------------- graph-mode ad.function

def test_graph_mode_ad_function_as_the_original_had_it_points_to_the_session(spec_path):
    """The original's integration cases built variables in a ``tf.Graph``, called
    ``autodist.function`` there with numpy arrays, and returned ops."""
    ad = AutoDist(spec_path, strategy.PS())
    inputs = np.random.RandomState(0).randn(16).astype(np.float32)
    with tf.Graph().as_default(), ad.scope():
        w = tf.Variable(5.0, name="W")

        @ad.function
        def train_step(batch):
            loss = tf.reduce_mean(tf.square(w * batch - 3.0 * batch))
            train_op = SGD().minimize(loss)
            return loss, train_op

        with pytest.raises(RuntimeError, match=r"train_step was called while TensorFlow builds "
                                               r"a graph.*ad\.create_distributed_session\(\)"):
            train_step(batch=inputs)


def test_graph_tensors_passed_to_ad_function_point_to_the_session(spec_path):
    ad = AutoDist(spec_path, strategy.PS())
    with ad.scope():
        step = ad.function(_shape_dependent_step())
    with tf.Graph().as_default():
        x = tf1.placeholder(tf.float32, [None, 6], name="x")
        y = tf1.placeholder(tf.float32, [None, 3], name="y")
    with pytest.raises(RuntimeError, match=r"rows_step was passed x:0, a graph's tensor.*"
                                           r"ad\.create_distributed_session\(\)"):
        step(x, y)


# ----------------------------------------------------------------------------- module paths

ORIGINAL_PATHS = {
    "ps_strategy": "PS",
    "ps_lb_strategy": "PSLoadBalancing",
    "partitioned_ps_strategy": "PartitionedPS",
    "uneven_partition_ps_strategy": "UnevenPartitionedPS",
    "all_reduce_strategy": "AllReduce",
    "partitioned_all_reduce_strategy": "PartitionedAR",
    "random_axis_partition_all_reduce_strategy": "RandomAxisPartitionAR",
    "parallax_strategy": "Parallax",
}


@pytest.mark.parametrize("module, name", sorted(ORIGINAL_PATHS.items()))
def test_the_original_strategy_module_paths_export_our_builders(module, name):
    alias = importlib.import_module(f"autodist.strategy.{module}")
    assert getattr(alias, name) is strategy.BUILDERS[name]


@pytest.mark.parametrize("member, unset, value, read", [
    ("AUTODIST_WORKER", "", "10.0.0.2", "10.0.0.2"),
    ("AUTODIST_STRATEGY_ID", "", "20200101T000000M000000", "20200101T000000M000000"),
    ("AUTODIST_MIN_LOG_LEVEL", "INFO", "DEBUG", "DEBUG"),
    ("AUTODIST_IS_TESTING", False, "True", True),
    ("AUTODIST_DEBUG_REMOTE", False, "yes", False),
    ("AUTODIST_PATCH_TF", True, "False", False),
    ("SYS_DATA_PATH", "", "/data", "/data"),
    ("SYS_RESOURCE_PATH", "", "/spec.yml", "/spec.yml"),
])
def test_const_env_reads_the_environment_as_the_original_did(monkeypatch, member, unset,
                                                             value, read):
    from autodist.const import ENV, Env
    variable = ENV[member]
    assert variable.name == member and Env[member] is variable
    monkeypatch.delenv(member, raising=False)
    assert variable.val == unset
    monkeypatch.setenv(member, value)
    assert variable.val == read
    assert len(ENV) == len({v.value for v in ENV})  # no member an alias of another
