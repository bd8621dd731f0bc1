"""The original AutoDist's integration cases, each compared with single-device training
(issue 56, item 7).

petuum/autodist's ``tests/integration/test_all.py`` ran its case scripts under each
strategy and passed when they ran to the end; it skipped AllReduce for every case
but two and PartitionedPS for the while loop. Here each case (``tests/original_cases.py``,
our own graphs on those scripts' logic) trains a few steps in a plain
``tf.compat.v1.Session`` and through ``ad.create_distributed_session()`` under
AllReduce, PartitionedPS and Parallax on the two-replica spec, and every logged value
(each step's loss, the step counter and variables read after it), every variable of
the graph (weights, the optimizer's slots and powers, the global step) and, where the
script saves one, the checkpoint must equal single-device training's.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
import tensorflow as tf

import original_cases
from autodist import AutoDist
from autodist.checkpoint import Saver
from autodist.strategy import AllReduce, Parallax, PartitionedPS

tf1 = tf.compat.v1

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ATOL = RTOL = 1e-5

BUILDERS = {"AllReduce": AllReduce, "PartitionedPS": PartitionedPS, "Parallax": Parallax}


def _run_steps(sess, case: original_cases.Case) -> list:
    """Each step's logged values: the training run's, then those read after it."""
    names = sorted(case.logged)
    after = sorted(case.after)
    log = []
    for feed in case.feeds:
        values = sess.run([case.train_op] + [case.logged[n] for n in names], feed)[1:]
        record = dict(zip(names, values))
        record.update(zip(after, sess.run([case.after[n] for n in after])))
        log.append(record)
    return log


def _global_state(sess) -> dict:
    """Every global variable of the default graph by name: weights, slots, step."""
    variables = tf1.global_variables()
    return dict(zip((v.op.name for v in variables), sess.run(variables)))


@functools.lru_cache(maxsize=None)
def train_single(case: str):
    """Single-device reference: (per-step log, initial state, final state)."""
    with tf.Graph().as_default():
        built = original_cases.CASES[case]()
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            initial = _global_state(sess)
            log = _run_steps(sess, built)
            return log, initial, _global_state(sess)


def train_autodist(spec: str, builder: str, case: str, checkpoint_dir):
    """AutoDist run: (per-step log, final state, the saved checkpoint's path or None)."""
    ad = AutoDist(resource_spec_file=spec, strategy_builder=BUILDERS[builder]())
    with tf.Graph().as_default(), ad.scope():
        built = original_cases.CASES[case]()
        # In the scope and after the optimizer, as Saver asks.
        saver = Saver(built.saved) if built.saved else None
        with ad.create_distributed_session() as sess:
            log = _run_steps(sess, built)
            state = _global_state(sess)
            path = (saver.save(sess, str(checkpoint_dir / "model"),
                               global_step=original_cases.STEPS) if saver else None)
    return log, state, path


def _assert_close(got, want, what: str) -> None:
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=what)


@functools.lru_cache(maxsize=None)
def _graph_names(case: str) -> tuple:
    """(the trainable variables' names, the checkpointed variables' names) of ``case``."""
    with tf.Graph().as_default():
        built = original_cases.CASES[case]()
        return (tuple(v.op.name for v in tf1.trainable_variables()),
                tuple(v.op.name for v in built.saved))


@pytest.mark.parametrize("builder", sorted(BUILDERS))
@pytest.mark.parametrize("case", sorted(original_cases.CASES))
def test_case_matches_single_device_training(spec_path, tmp_path, case, builder):
    want_log, initial, want = train_single(case)
    trainable, saved_names = _graph_names(case)
    # Not vacuous: every trainable variable moves by far more than the tolerance.
    for name in trainable:
        moved = np.abs(np.asarray(want[name]) - np.asarray(initial[name])).max()
        assert moved > 100 * ATOL, f"{case}: {name} barely moves ({moved:g})"

    log, got, path = train_autodist(spec_path, builder, case, tmp_path)

    assert len(log) == len(want_log)
    for step, (mine, theirs) in enumerate(zip(log, want_log)):
        assert sorted(mine) == sorted(theirs)
        for name in theirs:
            _assert_close(mine[name], theirs[name], f"{case}: {name!r} logged at step {step}")
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        _assert_close(got[name], value, f"{case}: variable {name!r} after training")
    assert (path is None) == (not saved_names)
    if path is not None:
        reader = tf.train.load_checkpoint(path)
        assert sorted(reader.get_variable_to_shape_map()) == sorted(saved_names)
        for name in saved_names:
            _assert_close(reader.get_tensor(name), want[name], f"{case}: checkpoint's {name!r}")
