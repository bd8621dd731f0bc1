"""The bounds after which a job counts a node as failed, and the README's statement of them.

The stuck-step watchdog runs here on one node: its clock is replaced by one that
a training step itself advances, so a step can "take" minutes in a second.
"""
import functools
import inspect
import os
import signal
import threading
import time
import types

import numpy as np
import pytest
import tensorflow as tf

from autodist import AutoDist, autodist as autodist_module, session
from autodist.cluster import runtime
from autodist.strategy import AllReduce

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")

pytestmark = pytest.mark.timeout(120)


def test_failure_handling_in_the_readme_states_the_bounds_the_code_uses():
    with open(README) as f:
        text = f.read()
    start = text.index("### Failure handling\n")
    section = " ".join(text[start:text.index("\n#", start + 1)].split())  # lines joined
    heartbeat = inspect.signature(runtime.ChiefCoordinator).parameters["heartbeat_timeout"]
    assert f"a worker silent for {heartbeat.default:g} s counts as dead" in section
    assert f"exits with status {128 + signal.SIGTERM}" in section
    assert (f"after {session.STUCK_FACTOR:g} times the median of the steps before it, at least "
            f"{session.STUCK_MIN_S:g} s (the first step after {session.STUCK_FIRST_S:g} s)"
            in section)
    assert f"any other exits {runtime.CHIEF_LOST_S:g} s after the chief stopped answering" \
        in section


def test_a_step_is_stuck_past_its_bound_from_the_median_step_the_floor_or_the_first_step(
        tmp_path, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(session, "time", types.SimpleNamespace(monotonic=lambda: clock[0],
                                                                sleep=time.sleep))
    asked = []

    def stuck_nodes(steps_done):
        asked.append(steps_done)
        return ["localhost"]

    # The single-node session, watched as a chief's is: a monitor, and who is stuck.
    monkeypatch.setattr(autodist_module, "DistributedSession", functools.partial(
        session.DistributedSession, monitor=lambda: None, stuck_nodes=stuck_nodes))
    plan = []  # per training step: (seconds it takes on the clock, real seconds it is held)
    release = threading.Event()

    def step_body():
        seconds, held = plan.pop(0)
        clock[0] += seconds
        release.wait(held)  # while held, the watchdog looks at the step
        return np.float32(1.0)

    spec = tmp_path / "one_replica.yml"
    spec.write_text("nodes:\n  - address: localhost\n    cpus: [0]\n")
    ad = AutoDist(str(spec), AllReduce())
    with tf.Graph().as_default(), ad.scope():
        w = tf.compat.v1.get_variable("w", [1], initializer=tf.compat.v1.ones_initializer(),
                                      use_resource=True)
        tick = tf.compat.v1.py_func(step_body, [], tf.float32, stateful=True)
        train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
            tf.reduce_sum(w * tick))
        sess = ad.create_distributed_session()

        def steps(*planned):
            plan.extend(planned)
            for _ in planned:
                sess.run(train)
            assert not plan

        def stuck_step(seconds) -> session.StuckStepError:
            before = sess.run(w)[0]
            plan.append((seconds, 10.0))  # the watchdog looks every 0.5 s
            try:
                with pytest.raises(session.StuckStepError) as info:
                    sess.run(train)
            finally:
                release.set()  # the step ends; the next ones are not held
            while sess.run(w)[0] == before:  # until its update has landed
                time.sleep(0.05)
            release.clear()
            return info.value

        # The first step (tracing, warm-up) may take up to STUCK_FIRST_S.
        steps((session.STUCK_FIRST_S - 50, 1.2))
        # 20 times a median step of 1 s is below the floor: STUCK_MIN_S holds.
        steps((1, 0), (1, 0), (1, 0), (session.STUCK_MIN_S - 1, 1.2))
        error = stuck_step(session.STUCK_MIN_S + 1)
        assert error.nodes == ["localhost"] and asked[-1] == 5
        assert f"bound {session.STUCK_MIN_S:.0f} s" in str(error)
        # Slower steps raise the bound: 20 times the median, 3 s.
        steps(*[(3, 0)] * 5, (session.STUCK_FACTOR * 3 - 1, 1.2))
        error = stuck_step(session.STUCK_FACTOR * 3 + 1)
        assert f"bound {session.STUCK_FACTOR * 3:.0f} s" in str(error)
        assert asked[-1] == 11
        sess.close()
