"""Trials: the user's own script, run for real under a candidate strategy, timed.

The search drives the script through the environment, which
:meth:`TrialHooks.from_environment` reads (the one place that does); ``AutoDist``
takes the hooks as an argument and asks them at each point a search changes:

* capture (``AUTODIST_CAPTURE=path``): the script builds its graph as usual;
  ``create_distributed_session`` writes the trainable variables to ``path`` and
  ends the process. The search samples strategies for them.
* trial (``AUTODIST_TRIAL={json}``): the chief applies the given strategy file
  instead of its builder, and the job runs the script's own training loop, its
  own feeds included: after ``warmup`` steps it times ``steps`` more, the chief
  writes the time per step to the result file, and every node ends its process.

A step is a ``run`` fetching the train op. Timing the script's own steps keeps
what synthetic inputs cannot know: valid ids for embedding lookups, how many
rows a step touches, the input pipeline's cost.
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import List, Optional, Sequence

from autodist.cluster import runtime
from autodist.graph_item import GraphItem, VariableInfo
from autodist.resource_spec import ResourceSpec
from autodist.strategy.base import Strategy
from autodist.strategy.common import check_int

CAPTURE_ENV = "AUTODIST_CAPTURE"
TRIAL_ENV = "AUTODIST_TRIAL"
SPEC_ENV = "AUTODIST_RESOURCE_SPEC"   # the spec the search runs the script on
STOP_GRACE_S = 10.0
PORTS_FREE_TIMEOUT_S = 60.0
# What a trial's log says when the cluster is busy with another job: no strategy's fault.
_BUSY_CLUSTER = ("cannot start its TensorFlow server", "StrategyServer cannot listen")
# Once a trial has succeeded, a run this many times slower than the slowest
# success (and slower than the floor) is taken for a hang and stopped.
HANG_FACTOR, HANG_FLOOR_S = 5.0, 120.0


def check_seconds(name: str, value: float, zero_ok: bool = False) -> None:
    """Refuses a duration that is not a finite number of seconds > 0 (>= 0 with ``zero_ok``).

    Raises:
        ValueError: naming ``name`` and ``value``; a bool is not a number here.
    """
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and (0 <= value if zero_ok else 0 < value) and value < math.inf):
        raise ValueError(f"{name} must be a finite number of seconds {'>=' if zero_ok else '>'} 0, "
                         f"got {value!r}.")


@dataclasses.dataclass(frozen=True)
class TrialSettings:
    """What a trial job does, as read from ``AUTODIST_TRIAL``.

    Attributes:
        strategy: the strategy file the chief applies.
        result: where the chief writes ``{"seconds_per_step": ...}``.
        warmup: steps run before timing (at least one: the first step pays for
            graph optimization and connection set-up).
        steps: timed steps.
    """

    strategy: str
    result: str
    warmup: int = 3
    steps: int = 10

    def __post_init__(self) -> None:
        for name in ("strategy", "result"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a file path, got {getattr(self, name)!r:.100}.")
        # The timer starts at the end of the last warm-up step: with none it never would.
        check_int("warmup", self.warmup)
        check_int("steps", self.steps)

    def to_env(self) -> str:
        return json.dumps(dataclasses.asdict(self))


def _trial_settings(raw: str) -> TrialSettings:
    """The settings in ``AUTODIST_TRIAL``: a JSON object of TrialSettings' fields.

    Raises:
        ValueError: naming the variable, its value (cut short) and what is wrong.
    """
    try:
        fields = json.loads(raw)
        if not isinstance(fields, dict):
            raise ValueError(f"a JSON {type(fields).__name__}, not an object")
        return TrialSettings(**fields)
    except (ValueError, TypeError, RecursionError) as err:  # bad JSON, fields or values
        raise _not_from_a_search(TRIAL_ENV, raw, f"is not a trial's settings "
                                 f"({str(err)[:200]})") from None


def _not_from_a_search(name: str, value: str, problem: str) -> ValueError:
    return ValueError(f"{name}={value[:100]!r} {problem}. 'autodist search' sets it for the "
                      "runs of the script it times; unset it to run the script yourself.")


class TrialFinished(SystemExit):
    """Ends a capture or trial job's process normally once its work is done."""

    def __init__(self):
        super().__init__(0)


@dataclasses.dataclass(frozen=True)
class TrialHooks:
    """What a strategy search changes in a job of the user's script; nothing when empty.

    Attributes:
        spec_path: the resource spec the search runs the script on, instead of its own.
        capture: where a capture run writes the graph's variables, then ends.
        trial: a trial run's settings: the strategy applied instead of the
            script's builder, and the steps timed.
    """

    spec_path: Optional[str] = None
    capture: Optional[str] = None
    trial: Optional[TrialSettings] = None

    @classmethod
    def from_environment(cls) -> "TrialHooks":
        """The hooks a search set for this process; empty outside a search.

        Raises:
            ValueError: naming the variable and its value (cut short) when one is
                not what a search sets: a spec file that does not exist, a capture
                path in no existing directory, trial settings that are not valid.
        """
        spec_path = os.environ.get(SPEC_ENV) or None
        if spec_path and not os.path.isfile(spec_path):
            raise _not_from_a_search(SPEC_ENV, spec_path, "names no file")
        capture = os.environ.get(CAPTURE_ENV) or None
        if capture and not os.path.isdir(os.path.dirname(os.path.abspath(capture))):
            raise _not_from_a_search(CAPTURE_ENV, capture, "is in no existing directory")
        raw = os.environ.get(TRIAL_ENV)
        return cls(spec_path=spec_path, capture=capture,
                   trial=_trial_settings(raw) if raw else None)

    def resource_spec_file(self, script_spec: str) -> str:
        return self.spec_path or script_spec

    def bind_to_search(self, is_chief: bool) -> None:
        """A search's run ends when the search does, however it ends (a kill -9 too): its
        chief then gets SIGTERM and stops its workers. Nothing outside a search."""
        if is_chief and (self.capture or self.trial):
            runtime.end_with_parent(signal.SIGTERM)

    def before_session(self, item: GraphItem, spec_path: str, is_chief: bool) -> None:
        """In a capture run, the chief writes what the search needs of the graph and ends."""
        if self.capture and is_chief:
            write_capture(self.capture, item, spec_path)
            raise TrialFinished()

    def strategy(self) -> Optional[Strategy]:
        """The strategy a trial applies instead of the script's builder."""
        return Strategy.load(self.trial.strategy) if self.trial else None

    def worker_env(self) -> dict:
        """What a trial's chief hands its workers: the trial and the spec the search runs on.

        Passed explicitly, since a worker reached over ssh inherits no environment
        and would otherwise run the script's own spec and builder.
        """
        env = {TRIAL_ENV: self.trial.to_env()} if self.trial else {}
        if self.spec_path:
            env[SPEC_ENV] = self.spec_path
        return env

    def step_timer(self, is_chief: bool) -> Optional["StepTimer"]:
        """In a trial, what times the steps and then ends the job."""
        return StepTimer(self.trial, is_chief) if self.trial else None


class StepTimer:
    """Counts a trial job's steps; after the timed ones, reports and ends the process.

    Args:
        settings: the trial's settings.
        is_chief: whether this node writes the result.
    """

    def __init__(self, settings: TrialSettings, is_chief: bool):
        self._settings = settings
        self._is_chief = is_chief
        self._count = 0
        self._start = 0.0

    def __call__(self) -> None:
        """Called after every step."""
        self._count += 1
        if self._count == self._settings.warmup:
            self._start = time.perf_counter()
        elif self._count == self._settings.warmup + self._settings.steps:
            seconds = (time.perf_counter() - self._start) / self._settings.steps
            if self._is_chief:
                _write_json(self._settings.result, {"seconds_per_step": seconds})
            raise TrialFinished()


def write_capture(path: str, item: GraphItem, spec_path: str) -> None:
    """The capture run's output: what the search needs to know of the graph."""
    _write_json(path, {"fingerprint": item.fingerprint, "spec": spec_path,
                       "accumulation_steps": item.accumulation_steps,
                       "sums_over_replicas": item.sums_over_replicas,
                       "variables": [dataclasses.asdict(v) for v in item.trainable_variables]})


@dataclasses.dataclass(frozen=True)
class CapturedGraph:
    """The trainable variables of a script's graph, as builders see a GraphItem."""

    trainable_variables: List[VariableInfo]
    fingerprint: str
    spec: str
    accumulation_steps: int = 1
    sums_over_replicas: bool = False  # ``GraphItem``'s


class ClusterBusyError(RuntimeError):
    """The cluster is busy with another job: no trial can measure a strategy there."""


@dataclasses.dataclass(frozen=True)
class TrialResult:
    """One trial: seconds per step, or None with the reason it failed."""

    seconds_per_step: Optional[float]
    error: str = ""
    wall_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.seconds_per_step is not None


class ScriptRunner:
    """Runs a training script in capture and trial mode.

    Args:
        argv: the script and its arguments, e.g. ``["train.py", "--steps", "100"]``;
            run with this Python.
        workdir: where strategies, results and logs of the trials go.
        spec_path: the resource spec the script must use (overrides its own).
        timeout: seconds a single run may take; after a successful trial, at most
            ``HANG_FACTOR`` times the slowest success per step, times the run's
            steps (but ``HANG_FLOOR_S`` or more).

    Raises:
        ValueError: when ``timeout`` is not a finite number > 0 (at 0 every run
            would be stopped at once and reported as a failure of the script).
        ClusterBusyError: when another search runs trials from this machine.
    """

    def __init__(self, argv: Sequence[str], workdir: str, spec_path: Optional[str] = None,
                 timeout: float = 600.0):
        check_seconds("timeout", timeout)
        self._lock = _lock_trials(argv)  # held while this runner lives
        self._argv = list(argv)
        self._workdir = workdir
        self._spec_path = spec_path
        self._timeout = timeout
        self._script_spec = None   # the script's own spec, read by capture()
        self._slowest_success = 0.0  # the longest wall time of a success per step run
        self._runs = 0
        os.makedirs(workdir, exist_ok=True)

    def capture(self) -> CapturedGraph:
        """Runs the script until its session would start; returns its variables.

        Raises:
            RuntimeError: when the script fails or never creates a session.
        """
        path = os.path.join(self._workdir, "captured.json")
        if os.path.exists(path):
            os.remove(path)
        code, log = self._run({CAPTURE_ENV: path}, "capture", self._timeout)
        if not os.path.exists(path):
            how = (f"timed out after {self._timeout:.0f} s" if code is None
                   else f"failed (exit code {code})")
            raise RuntimeError(f"Running {self._argv} to read its graph {how} before it "
                               f"created a session; see {log}.")
        with open(path) as source:
            data = json.load(source)
        variables = [VariableInfo(**dict(v, shape=tuple(v["shape"]))) for v in data["variables"]]
        self._script_spec = data["spec"]
        return CapturedGraph(variables, data["fingerprint"], data["spec"],
                             data["accumulation_steps"], data["sums_over_replicas"])

    def trial(self, strategy: Strategy, warmup: int = 3, steps: int = 10) -> TrialResult:
        """Runs the script under ``strategy``; returns its time per step."""
        self._runs += 1
        name = f"trial-{self._runs:03d}"
        settings = TrialSettings(strategy=strategy.save(os.path.join(self._workdir,
                                                                     f"{name}.strategy")),
                                 result=os.path.join(self._workdir, f"{name}.json"),
                                 warmup=warmup, steps=steps)
        if os.path.exists(settings.result):  # an earlier search's, in a reused workdir
            os.remove(settings.result)
        spec = self._spec_path or self._script_spec
        # A spec gone missing is the script's own error to report, in its log.
        if spec and os.path.isfile(spec) and not runtime.wait_until_tf_ports_free(
                ResourceSpec(spec), PORTS_FREE_TIMEOUT_S):
            raise ClusterBusyError(
                f"A node of {spec} still listened on the TensorFlow port {runtime.tf_port()} "
                f"after {PORTS_FREE_TIMEOUT_S:.0f} s: another job runs on the cluster. The "
                "search stops rather than measure nothing; run it once that job is over.")
        start = time.monotonic()
        timeout = self._trial_timeout(warmup + steps)
        code, log = self._run({TRIAL_ENV: settings.to_env()}, name, timeout)
        wall = time.monotonic() - start
        if code == 0 and os.path.exists(settings.result):
            self._slowest_success = max(self._slowest_success, wall / (warmup + steps))
            with open(settings.result) as source:
                return TrialResult(json.load(source)["seconds_per_step"], wall_seconds=wall)
        if code is None:
            return TrialResult(None, f"timed out after {timeout:.0f} s; see {log}", wall)
        if code == 0:
            return TrialResult(None, f"the script ended before {warmup + steps} steps; "
                                     f"see {log}", wall)
        busy = _busy_cluster_line(log)
        if busy:
            raise ClusterBusyError(
                f"Trial {name} could not start its job ({busy}): another job holds the "
                f"cluster's ports. The search stops rather than count that against the "
                f"strategy; see {log}.")
        return TrialResult(None, f"exit code {code}; see {log}", wall)

    def _trial_timeout(self, steps: int) -> float:
        # Per step, since later trials may time more steps (min_timed_seconds); the
        # start-up share of the wall time then makes the bound only more lenient.
        if not self._slowest_success:
            return self._timeout
        return min(self._timeout,
                   max(HANG_FLOOR_S, HANG_FACTOR * self._slowest_success * steps))

    def _run(self, env: dict, name: str, timeout: float):
        """Runs the script once; returns (exit code or None on timeout, log path)."""
        log_path = os.path.join(self._workdir, f"{name}.log")
        env = dict(os.environ, **env)
        if self._spec_path:
            env[SPEC_ENV] = os.path.abspath(self._spec_path)
        with open(log_path, "w") as log:
            process = subprocess.Popen([sys.executable, *self._argv], stdout=log,
                                       stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True)
            try:
                return process.wait(timeout=timeout), log_path
            except subprocess.TimeoutExpired:
                _stop(process)
                return None, log_path
            except BaseException:
                # Ctrl-C or an error ends the search. The job runs in a session of its
                # own, which the terminal's SIGINT never reaches: stop it, or it trains on.
                _stop(process)
                raise


def _busy_cluster_line(log_path: str) -> str:
    """The line of a failed trial's log saying another job holds the cluster, or ""."""
    try:
        with open(log_path, errors="replace") as log:
            lines = log.read()[-20000:].splitlines()
    except OSError:
        return ""
    return next((line.strip()[:300] for line in reversed(lines)
                 if any(mark in line for mark in _BUSY_CLUSTER)), "")


def _lock_trials(argv: Sequence[str]):
    """An exclusive lock on this machine's trials for the TensorFlow port in use, or
    None when this process holds it already; a second search here would take the
    first one's nodes. The kernel releases it when the search's process ends,
    however it ends.

    Raises:
        ClusterBusyError: naming the search that holds it.
    """
    path = os.path.join(tempfile.gettempdir(), f"autodist-search-{runtime.tf_port()}.lock")
    lock = open(path, "a+", encoding="utf-8")  # pylint: disable=consider-using-with
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        if holder.startswith(f"pid {os.getpid()}:"):
            return None  # this process's own search (an AutoStrategy of its script)
        raise ClusterBusyError(
            f"Another AutoDist search runs trials from this machine on TensorFlow port "
            f"{runtime.tf_port()} ({holder}); two searches would take each other's nodes "
            "and time each other's trials. Wait until it ends, or search on other nodes "
            f"with another {runtime.TF_PORT_ENV}.") from None
    lock.truncate(0)
    lock.write(f"pid {os.getpid()}: {' '.join(map(str, argv))[:200]}\n")
    lock.flush()
    return lock


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM first: the chief then stops its workers; SIGKILL if it lingers (its
    workers then end with it, see ``runtime.WorkerAgent``)."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _write_json(path: str, data: dict) -> None:
    """Writes ``path`` whole or not at all: the reader may look at any moment."""
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "w") as target:
        json.dump(data, target)
    os.replace(temporary, path)
