"""Trials: the README's example script captured and timed under candidate strategies."""
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from autodist.cluster import runtime
from autodist.resource_spec import ResourceSpec
from autodist.strategy import PS, AllReduce, common
from autodist.search import trial
from autodist.search.trial import ClusterBusyError, ScriptRunner
from autodist.strategy.base import Strategy

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "train_mlp.py")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    return ScriptRunner([EXAMPLE], str(tmp_path_factory.mktemp("capture"))).capture()


def test_capture_reads_the_scripts_variables_without_training(captured):
    shapes = sorted(v.shape for v in captured.trainable_variables)
    assert shapes == [(1,), (16, 32), (32,), (32, 1)]
    assert all(v.has_grad and not v.sparse_grad for v in captured.trainable_variables)
    assert os.path.samefile(captured.spec, os.path.join(os.path.dirname(EXAMPLE), "..",
                                                        "configs", "local_2cpu.yml"))


@pytest.mark.parametrize("builder", [PS, AllReduce])
def test_a_trial_times_the_scripts_own_steps(captured, tmp_path, builder):
    runner = ScriptRunner([EXAMPLE, "--steps", "50"], str(tmp_path))
    strategy = builder().build(captured, ResourceSpec(captured.spec))
    result = runner.trial(strategy, warmup=2, steps=5)
    assert result.ok, result.error
    assert 0 < result.seconds_per_step * 5 < result.wall_seconds
    log = (tmp_path / "trial-001.log").read_text()
    # The job ended inside step 7 (index 6): it neither trained on nor printed its strategy.
    assert "step   5  loss" in log and "step   6" not in log and "Strategy" not in log


def test_a_script_ending_before_the_timed_steps_fails_the_trial(captured, tmp_path):
    runner = ScriptRunner([EXAMPLE, "--steps", "4"], str(tmp_path))
    result = runner.trial(PS().build(captured, ResourceSpec(captured.spec)), warmup=2, steps=5)
    assert not result.ok and "ended before 7 steps" in result.error


def test_a_strategy_that_does_not_fit_fails_the_trial_with_its_log(captured, tmp_path):
    runner = ScriptRunner([EXAMPLE], str(tmp_path))
    strategy = PS().build(captured, ResourceSpec(captured.spec))
    strategy.node_config.append(common.ps_node_config("no/such/variable", "localhost:CPU:0"))
    result = runner.trial(strategy, warmup=1, steps=1)
    assert not result.ok and "exit code 1" in result.error
    assert "no/such/variable" in (tmp_path / "trial-001.log").read_text()


def test_the_search_spec_overrides_the_scripts_own(spec_path_4cpu, tmp_path):
    runner = ScriptRunner([EXAMPLE], str(tmp_path), spec_path=spec_path_4cpu)
    captured = runner.capture()
    assert os.path.samefile(captured.spec, spec_path_4cpu)
    strategy = AllReduce().build(captured, ResourceSpec(captured.spec))
    assert len(strategy.replicas) == 4
    result = runner.trial(strategy, warmup=1, steps=2)
    assert result.ok, result.error


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan")])
def test_a_runner_refuses_a_timeout_that_is_not_a_finite_positive_number(tmp_path, timeout):
    # At 0 every run would be stopped at once and blamed on the script.
    with pytest.raises(ValueError, match="timeout must be a finite number of seconds > 0"):
        ScriptRunner([EXAMPLE], str(tmp_path / "work"), timeout=timeout)
    assert not (tmp_path / "work").exists()


SLOW_ON_SECOND_RUN = """
import json, os, sys, time
settings = json.loads(os.environ["AUTODIST_TRIAL"])
with open(sys.argv[1], "a") as pids:
    pids.write(f"{os.getpid()}\\n")
if len(open(sys.argv[1]).read().split()) > 1:
    time.sleep(float(sys.argv[2]))
with open(settings["result"], "w") as result:
    json.dump({"seconds_per_step": 0.5}, result)
"""


@pytest.mark.timeout(60)
def test_a_trial_far_slower_than_earlier_ones_is_stopped_as_a_hang(tmp_path, monkeypatch):
    monkeypatch.setattr(trial, "HANG_FLOOR_S", 3.0)
    script, pids = tmp_path / "hangs.py", tmp_path / "pids"
    script.write_text(SLOW_ON_SECOND_RUN)
    runner = ScriptRunner([str(script), str(pids), "1000"], str(tmp_path / "work"), timeout=600)
    strategy = Strategy()
    assert runner.trial(strategy).seconds_per_step == 0.5
    start = time.monotonic()
    second = runner.trial(strategy)
    assert not second.ok and "timed out after 3 s" in second.error
    assert time.monotonic() - start < 30
    hung = int(pids.read_text().split()[1])
    with pytest.raises(ProcessLookupError):
        os.kill(hung, 0)


@pytest.mark.timeout(60)
def test_the_hang_bound_grows_with_the_steps_a_trial_times(tmp_path, monkeypatch):
    # min_timed_seconds can ask later trials for many more steps than the first timed.
    monkeypatch.setattr(trial, "HANG_FLOOR_S", 3.0)
    script = tmp_path / "slower.py"
    script.write_text(SLOW_ON_SECOND_RUN)
    runner = ScriptRunner([str(script), str(tmp_path / "pids"), "5"], str(tmp_path / "work"))
    assert runner.trial(Strategy(), warmup=1, steps=2).ok
    longer = runner.trial(Strategy(), warmup=1, steps=3000)
    assert longer.ok, longer.error


def test_a_trial_waits_until_the_previous_jobs_ports_are_free(monkeypatch):
    with socket.socket() as listener:
        listener.bind(("127.0.0.2", 0))
        listener.listen()
        monkeypatch.setenv(runtime.TF_PORT_ENV, str(listener.getsockname()[1]))
        spec = ResourceSpec.from_dict({"nodes": [{"address": "127.0.0.1", "chief": True},
                                                 {"address": "127.0.0.2"}]})
        start = time.monotonic()
        assert not runtime.wait_until_tf_ports_free(spec, timeout=1.0)
        assert time.monotonic() - start >= 1.0
        threading.Timer(1.0, listener.close).start()
        assert runtime.wait_until_tf_ports_free(spec, timeout=20.0)


ENDS_WITHOUT_A_RESULT = """
import os, sys, time
with open(sys.argv[1], "w") as pid:
    pid.write(str(os.getpid()))
time.sleep(float(sys.argv[2]))
"""


def _script(tmp_path, seconds: float) -> list:
    """A script that writes its pid to ``pid`` and sleeps ``seconds`` without timing a step."""
    script = tmp_path / "sleeps.py"
    script.write_text(ENDS_WITHOUT_A_RESULT)
    return [str(script), str(tmp_path / "pid"), str(seconds)]


@pytest.mark.timeout(60)
def test_an_earlier_searchs_result_file_is_not_taken_for_the_trials(tmp_path):
    # A second search reuses log_dir/trials, whose trial-001.json is the first search's.
    work = tmp_path / "work"
    work.mkdir()
    (work / "trial-001.json").write_text('{"seconds_per_step": 0.1}')
    result = ScriptRunner(_script(tmp_path, 0), str(work)).trial(Strategy(), warmup=1, steps=1)
    assert not result.ok and "ended before 2 steps" in result.error


class _Interrupted(Exception):
    pass


@pytest.mark.timeout(60)
def test_an_interrupted_trial_stops_its_job(tmp_path):
    # The job runs in a session of its own, so Ctrl-C at the terminal reaches the search only.
    def interrupt(signum, frame):
        raise _Interrupted()

    # SIGUSR1, not SIGALRM: pytest-timeout keeps its own alarm for this test.
    previous = signal.signal(signal.SIGUSR1, interrupt)
    timer = threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGUSR1))
    timer.start()
    try:
        with pytest.raises(_Interrupted):
            ScriptRunner(_script(tmp_path, 1000), str(tmp_path / "work")).trial(Strategy())
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, previous)
    with pytest.raises(ProcessLookupError):
        os.kill(int((tmp_path / "pid").read_text()), 0)


@pytest.mark.timeout(60)
def test_a_capture_that_times_out_says_so(tmp_path):
    runner = ScriptRunner(_script(tmp_path, 1000), str(tmp_path / "work"), timeout=1.0)
    with pytest.raises(RuntimeError, match="timed out after 1 s before it created a session"):
        runner.capture()


@pytest.mark.parametrize("field", ["warmup", "steps"])
def test_trial_settings_refuse_fewer_than_one_step(field):
    # With no warm-up step the timer would never start.
    with pytest.raises(ValueError, match=f"{field} must be an integer >= 1, got 0"):
        trial.TrialSettings(**{"strategy": "s", "result": "r", field: 0})


def test_a_trials_workers_reached_over_ssh_get_its_settings_and_spec(monkeypatch, tmp_path):
    # ssh passes no environment on: without these the worker would run the
    # script's own spec and builder.
    from autodist.cluster import launcher
    search_spec = tmp_path / "search.yml"
    search_spec.write_text("nodes: [{address: localhost}]\n")
    monkeypatch.setenv(trial.SPEC_ENV, str(search_spec))
    settings = trial.TrialSettings(strategy="/jobs/t.strategy", result="/jobs/t.json")
    monkeypatch.setenv(trial.TRIAL_ENV, settings.to_env())
    hooks = trial.TrialHooks.from_environment()
    assert hooks == trial.TrialHooks(spec_path=str(search_spec), trial=settings)
    env = hooks.worker_env()
    assert env == {trial.TRIAL_ENV: settings.to_env(), trial.SPEC_ENV: str(search_spec)}
    spec = ResourceSpec.from_dict({"nodes": [{"address": "10.0.0.1", "chief": True},
                                             {"address": "10.0.0.2", "ssh_config": "c"}],
                                   "ssh": {"c": {"username": "u"}}})
    command = launcher.worker_command(spec.node("10.0.0.2"), spec.ssh_configs["c"], env,
                                      ["train.py"], "/jobs")
    assert f"AUTODIST_RESOURCE_SPEC={search_spec}" in command[-1]
    monkeypatch.delenv(trial.SPEC_ENV)
    monkeypatch.delenv(trial.TRIAL_ENV)
    assert trial.TrialHooks.from_environment() == trial.TrialHooks()
    assert trial.TrialHooks().worker_env() == {}


@pytest.mark.parametrize("name, value, named", [
    (trial.TRIAL_ENV, "{not json", "AUTODIST_TRIAL='{not json' is not a trial's settings"),
    (trial.TRIAL_ENV, "[1, 2]", "a JSON list, not an object"),
    (trial.TRIAL_ENV, '{"strategy": "s"}', "missing 1 required positional argument: 'result'"),
    (trial.TRIAL_ENV, '{"strategy": "s", "result": "r", "colour": 1}',
     "unexpected keyword argument 'colour'"),
    (trial.TRIAL_ENV, '{"strategy": 5, "result": "r"}', "strategy must be a file path, got 5"),
    (trial.TRIAL_ENV, '{"strategy": "s", "result": "r", "steps": "ten"}',
     "steps must be an integer >= 1, got 'ten'"),
    (trial.TRIAL_ENV, "[" * 100000, "AUTODIST_TRIAL='" + "[" * 100 + "' is not"),
    (trial.CAPTURE_ENV, "/no/such/directory/capture.json",
     "AUTODIST_CAPTURE='/no/such/directory/capture.json' is in no existing directory"),
    (trial.SPEC_ENV, "/no/such/spec.yml",
     "AUTODIST_RESOURCE_SPEC='/no/such/spec.yml' names no file"),
])
def test_a_bad_search_variable_is_named(monkeypatch, name, value, named):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as info:
        trial.TrialHooks.from_environment()
    message = str(info.value)
    assert named in message and "unset it to run the script yourself" in message, message
    assert len(message) < 1000


def test_trial_hooks_passed_to_autodist_capture_the_graph_and_end_the_job(tmp_path,
                                                                          monkeypatch):
    """No environment: the hooks are an argument, and the capture ends the process normally."""
    import tensorflow as tf
    from autodist import AutoDist
    # A capture run ends with the search that started it. Here that would bind the test
    # runner to its parent, and end it at once where that parent is gone (a run in the
    # background): the binding is recorded instead.
    bound = []
    monkeypatch.setattr(runtime, "end_with_parent", bound.append)
    spec = tmp_path / "spec.yml"
    spec.write_text("nodes:\n  - address: localhost\n    cpus: [0, 1]\n    chief: true\n")
    hooks = trial.TrialHooks(capture=str(tmp_path / "captured.json"))
    ad = AutoDist(str(tmp_path / "missing.yml"), trial_hooks=dataclasses.replace(
        hooks, spec_path=str(spec)))
    assert ad.resource_spec.source == str(spec)
    with tf.Graph().as_default(), ad.scope():
        weight = tf.Variable(tf.ones([3, 2]), name="w")
        loss = tf.reduce_sum(tf.matmul(tf.ones([4, 3]), weight))
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        with pytest.raises(trial.TrialFinished) as finished:
            ad.create_distributed_session()
    assert finished.value.code == 0
    assert bound == [signal.SIGTERM]
    captured = json.loads((tmp_path / "captured.json").read_text())
    assert [v["name"] for v in captured["variables"]] == ["w"]
    assert captured["spec"] == str(spec)


HOLDS_THE_LOCK = """
import sys, time
from autodist.search.trial import ScriptRunner
runner = ScriptRunner(["train.py"], sys.argv[1])
print("holding", flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_a_second_search_on_this_machine_is_refused_naming_the_first(tmp_path, monkeypatch):
    monkeypatch.setenv(runtime.TF_PORT_ENV, "15961")  # this test's own lock
    first = subprocess.Popen([sys.executable, "-c", HOLDS_THE_LOCK, str(tmp_path / "first")],
                             stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    try:
        assert first.stdout.readline().strip() == "holding"
        with pytest.raises(ClusterBusyError, match=rf"Another AutoDist search runs trials from "
                                                   rf"this machine on TensorFlow port 15961 "
                                                   rf"\(pid {first.pid}: train.py\)"):
            ScriptRunner(["mine.py"], str(tmp_path / "second"))
    finally:
        first.kill()
        first.wait()
    # Its process gone, the lock is free again, whatever ended it.
    ScriptRunner(["mine.py"], str(tmp_path / "third"))


PORT_TAKEN = """
import sys
sys.stderr.write("RuntimeError: Node '10.0.0.1' cannot start its TensorFlow server: port 15470 "
                 "is already in use (Address already in use). Free it or set AUTODIST_TF_PORT.\\n")
sys.exit(1)
"""


@pytest.mark.timeout(60)
def test_a_trial_that_finds_the_cluster_busy_stops_the_search(tmp_path):
    """Not a failed strategy: the search must not go on and conclude from such trials."""
    script = tmp_path / "busy.py"
    script.write_text(PORT_TAKEN)
    runner = ScriptRunner([str(script)], str(tmp_path / "work"))
    with pytest.raises(ClusterBusyError, match=r"Trial trial-001 could not start its job "
                                               r"\(RuntimeError: Node '10.0.0.1' cannot start "
                                               r"its TensorFlow server"):
        runner.trial(Strategy(), warmup=1, steps=1)


TRIAL_JOB = """
import os, sys, time
from autodist import AutoDist
ad = AutoDist(sys.argv[1])
with open(sys.argv[2], "w") as pid:
    pid.write(str(os.getpid()))
time.sleep(120)
"""
SEARCH = """
import sys
from autodist.search.trial import ScriptRunner
from autodist.strategy.base import Strategy
ScriptRunner(sys.argv[1:4], sys.argv[4], timeout=120).trial(Strategy(), warmup=1, steps=1)
"""


@pytest.mark.timeout(90)
def test_a_search_killed_outright_takes_its_trial_with_it(tmp_path, spec_path, monkeypatch):
    monkeypatch.setenv(runtime.TF_PORT_ENV, "15962")  # this test's own search lock
    job = tmp_path / "job.py"
    job.write_text(TRIAL_JOB)
    pid = tmp_path / "pid"
    search = subprocess.Popen(
        [sys.executable, "-c", SEARCH, str(job), spec_path, str(pid), str(tmp_path / "work")],
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    try:
        deadline = time.monotonic() + 60
        while not (pid.exists() and pid.read_text()) and time.monotonic() < deadline:
            time.sleep(0.2)
        trial_pid = int(pid.read_text())
        search.kill()
        search.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(trial_pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        with pytest.raises(ProcessLookupError):
            os.kill(trial_pid, 0)
    finally:
        if search.poll() is None:
            search.kill()
