"""AutoStrategy: a builder that searches for the strategy, with the user's script as the trial.

``AutoStrategy(trials=30)`` is used like any builder. At session creation the
chief samples and scores candidate strategies, runs the most promising ones as
trials (this same script, restarted under each strategy and timed over a few of
its own steps) and returns the fastest measured. Everything it learns goes to
``log_dir``:

* ``trials.jsonl``: every trial (strategy id, source, predicted, measured);
* ``best.strategy``: the result, to reuse with ``Strategy.load``;
* ``search.png``: best time so far and hit rate against trials;
* ``simulator.npz`` and ``calibration.json``: the trained simulator and the cost
  model's weights refitted to the trials, picked up again by the next search on
  the same graph and cluster;
* ``trials/``: each trial's strategy, result and log.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import signal
import sys
import threading
from typing import Any, Iterator, List, Optional, Tuple

from autodist.resource_spec import ResourceSpec
from autodist.simulator.calibration import Calibration
from autodist.simulator.features import FEATURE_NAMES, FEATURES_VERSION
from autodist.simulator.ranking import RankingSimulator, SimulatorStateError
from autodist.strategy import BUILDERS
from autodist.search.sampler import SamplerConstraints
from autodist.search.search import SearchResult, StrategySearch, plot, write_log
from autodist.search.trial import ScriptRunner, check_seconds
from autodist.strategy.base import Strategy, StrategyBuilder
from autodist.strategy.common import check_int


@dataclasses.dataclass(frozen=True)
class SearchSettings:
    """How a search runs; the arguments of :class:`AutoStrategy` and ``autodist search``.

    Raises:
        ValueError: naming the field and its value, when a count is below its
            least, ``trial_timeout`` is not a finite number > 0 or
            ``min_timed_seconds`` not a finite number >= 0.
    """

    trials: int = 30
    candidates: int = 2000
    per_round: int = 4
    batch_size: int = 32
    allow_lossy: bool = False
    with_builders: bool = True
    warmup: int = 3
    steps: int = 10
    trial_timeout: float = 600.0
    log_dir: str = "autodist_search"
    seed: int = 0
    progress: bool = True
    min_timed_seconds: float = 0.0

    def __post_init__(self) -> None:
        # Checked here rather than by each caller, so AutoStrategy, `autodist search`
        # and the benchmarks refuse the same values.
        for name, least in (("trials", 0), ("candidates", 1), ("per_round", 1),
                            ("batch_size", 1), ("warmup", 1), ("steps", 1)):
            check_int(name, getattr(self, name), least)
        check_seconds("trial_timeout", self.trial_timeout)
        check_seconds("min_timed_seconds", self.min_timed_seconds, zero_ok=True)

    def constraints(self) -> SamplerConstraints:
        return SamplerConstraints(allow_fp16=self.allow_lossy,
                                  max_staleness=2 if self.allow_lossy else 0)


class AutoStrategy(StrategyBuilder):
    """Searches for the fastest strategy of the graph on the cluster.

    Args:
        trials: real runs the search may spend; 0 picks by the simulator alone.
        candidates: strategies sampled and scored per round.
        per_round: trials per round (the simulator is retrained after each round).
        batch_size: examples per replica and step, for the simulator's estimate
            of sparse traffic.
        allow_lossy: allow fp16 compression and bounded staleness, which
            change the numbers training computes.
        with_builders: open the search by measuring the hand-written builders
            (within the budget); the result is then never slower than the best
            of them, as measured.
        warmup: a trial's steps before timing.
        steps: a trial's timed steps, at least; see ``min_timed_seconds``.
        trial_timeout: seconds a trial may take.
        log_dir: where the log, the best strategy, the plot and the simulator go.
        seed: seed of the sampler and the simulator.
        progress: show a progress bar.
        min_timed_seconds: once a trial has been measured, later trials time
            enough steps to last this long at the fastest step time measured so
            far, since a few steps of a fast model are too short to rank by.
            The script must then train that many steps; 0 times ``steps`` only.

    Raises:
        ValueError: from :class:`SearchSettings`, for a count below its least,
            a ``trial_timeout`` that is not > 0 or a negative ``min_timed_seconds``.

    Note:
        The script must train at least ``warmup + steps`` steps, fetching the
        train op, and may not depend on anything that runs only once (a trial
        restarts it from the beginning, with the resource spec of the search).
    """

    def __init__(self, trials: int = 30, candidates: int = 2000, per_round: int = 4,
                 batch_size: int = 32, allow_lossy: bool = False, with_builders: bool = True,
                 warmup: int = 3, steps: int = 10, trial_timeout: float = 600.0,
                 log_dir: str = "autodist_search", seed: int = 0, progress: bool = True,
                 min_timed_seconds: float = 0.0):
        self.settings = SearchSettings(trials, candidates, per_round, batch_size, allow_lossy,
                                       with_builders, warmup, steps, trial_timeout, log_dir,
                                       seed, progress, min_timed_seconds)

    def build(self, graph_item, resource_spec: ResourceSpec) -> Strategy:
        runner = None  # a pick by the simulator alone runs no trial, so takes no trial lock
        if self.settings.trials:
            argv = [os.path.abspath(sys.argv[0]), *sys.argv[1:]]
            runner = ScriptRunner(argv, os.path.join(self.settings.log_dir, "trials"),
                                  spec_path=resource_spec.source,
                                  timeout=self.settings.trial_timeout)
        result = search_strategy(graph_item, resource_spec, runner, self.settings)
        if result.interrupted:  # saved, then the script stops as Ctrl-C asks
            print(f"Search interrupted: the best strategy so far is saved in "
                  f"{self.settings.log_dir}/best.strategy.", flush=True)
            raise KeyboardInterrupt
        return result.best


def search_strategy(graph: Any, resource_spec: ResourceSpec, runner: Optional[ScriptRunner],
                    settings: SearchSettings, out: Optional[str] = None) -> SearchResult:
    """Runs a search and writes its results to ``settings.log_dir``.

    Args:
        graph: a ``GraphItem`` or ``CapturedGraph`` (its ``trainable_variables``).
        resource_spec: the cluster.
        runner: runs the trials; unused with ``settings.trials == 0``.
        settings: how to search.
        out: another path to save the best strategy to, with ``best.strategy``.

    Returns:
        SearchResult: ``best`` is also saved as ``best.strategy`` (and at ``out``),
        before the plot is drawn: a Ctrl-C while they are saved is held back until
        they are, one while the plot is drawn skips it; both mark it ``interrupted``.
    """
    os.makedirs(settings.log_dir, exist_ok=True)
    simulator_path = os.path.join(settings.log_dir, "simulator.npz")
    calibration_path = os.path.join(settings.log_dir, "calibration.json")
    key = _problem_key(graph, resource_spec)
    simulator, calibration = _load_simulator(simulator_path, calibration_path, key)
    search = StrategySearch(graph, resource_spec, batch_size=settings.batch_size,
                            constraints=settings.constraints(), candidates=settings.candidates,
                            per_round=settings.per_round, seed=settings.seed,
                            simulator=simulator, calibration=calibration)
    if settings.trials == 0:
        best = search.best_predicted()
        result = SearchResult(best, None, [], None, search.simulator, search.calibration)
    else:
        builders = ({name: cls().build(graph, resource_spec) for name, cls in BUILDERS.items()}
                    if settings.with_builders else {})
        log_path = os.path.join(settings.log_dir, "trials.jsonl")
        progress = _Progress(settings.trials) if settings.progress else None

        def on_trial(entry, so_far):
            write_log(log_path, so_far.trials)
            if progress is not None:
                progress.update(entry, so_far)

        measured = []  # step times of the trials that succeeded so far

        def trial(strategy):
            steps = timed_steps(settings.steps, settings.min_timed_seconds,
                                min(measured, default=None))
            outcome = runner.trial(strategy, settings.warmup, steps)
            if outcome.ok:
                measured.append(outcome.seconds_per_step)
            return outcome

        result = search.run(trial, settings.trials, builders, on_trial)
    # What a search cost is saved before anything else, whole even if a second Ctrl-C
    # arrives meanwhile; the plot, which only shows it, comes last and may be cut short.
    with _interrupts_deferred() as interrupts:
        for path in dict.fromkeys([os.path.join(settings.log_dir, "best.strategy"), out]):
            if path is not None:
                result.best.save(path)
        if search.simulator.trained:
            search.simulator.save(simulator_path)
            with open(calibration_path, "w") as target:
                json.dump(result.calibration.to_json(), target, indent=1)
            with open(f"{simulator_path}.key", "w") as key_file:
                key_file.write(key)
    result.interrupted |= bool(interrupts)
    if settings.trials and not interrupts:
        try:
            result.plot_path = plot(os.path.join(settings.log_dir, "search.png"), result)
        except KeyboardInterrupt:
            result.interrupted = True
    if result.interrupted and result.plot_path is None and settings.trials:
        result.plot_skipped = True
    return result


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[List[int]]:
    """Holds back Ctrl-C (SIGINT) within the block; yields the signals that arrived.

    Python lets a handler be set from the main thread only; elsewhere (a
    notebook's worker thread, say) the block runs as it is.
    """
    arrived: List[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield arrived
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: arrived.append(signum))
    try:
        yield arrived
    finally:
        signal.signal(signal.SIGINT, previous)


def timed_steps(steps: int, min_seconds: float, fastest: Optional[float]) -> int:
    """Timed steps of a trial: ``steps``, or more to last ``min_seconds`` at ``fastest`` s/step."""
    if not fastest:
        return steps
    return max(steps, math.ceil(min_seconds / fastest))


class _Progress:
    """One line per trial: its source, its time, the best so far and the hit rate."""

    def __init__(self, trials: int):
        self._trials = trials

    def update(self, entry, so_far: SearchResult) -> None:
        print(format_progress(entry.index, self._trials, entry.source,
                              entry.result.seconds_per_step if entry.result.ok else None,
                              so_far.best_seconds, so_far.hit_rate), flush=True)


def format_progress(index: int, trials: int, source: str, seconds: Optional[float],
                    best_seconds: Optional[float], hit_rate: Optional[float]) -> str:
    """A progress line, e.g. ``trial 3/30  sampled      2.2 ms · best 2.2 ms · hit rate 50%``.

    Args:
        source: the trial's source (``builder:<name>``, ``search``, ``explore``).
        seconds: the trial's time per step, or None when it failed.
        best_seconds: the fastest time so far, or None.
        hit_rate: the share of searched trials faster than the best builder, or None.
    """
    if source.startswith("builder:"):
        origin = source.split(":", 1)[1]
    else:
        origin = "sampled at random" if source == "explore" else "sampled"
    parts = [f"{1e3 * seconds:.1f} ms" if seconds is not None else "failed"]
    if best_seconds is not None:
        parts.append(f"best {1e3 * best_seconds:.1f} ms")
    if hit_rate is not None:
        parts.append(f"hit rate {100 * hit_rate:.0f}%")
    width = len(str(trials))
    return f"trial {index:>{width}}/{trials}  {origin:<20} " + " · ".join(parts)


def _problem_key(graph, resource_spec: ResourceSpec) -> str:
    """Identifies a (model, cluster) and the features' version a simulator was trained on."""
    variables = [dataclasses.astuple(v) for v in graph.trainable_variables]
    nodes = [(n.address, list(n.cpus), list(n.gpus)) for n in resource_spec.nodes]
    text = json.dumps([variables, nodes, sorted(resource_spec.network_bandwidth.items()),
                       FEATURES_VERSION], default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _load_simulator(path: str, calibration_path: str, key: str
                    ) -> Tuple[Optional[RankingSimulator], Optional[Calibration]]:
    """The saved simulator and calibration if they were trained on the same model and cluster.

    Both or neither: the simulator's scores build on the calibration's prediction.
    """
    try:
        with open(f"{path}.key") as key_file:
            if key_file.read().strip() != key:
                return None, None
        simulator = RankingSimulator.load(path)
        with open(calibration_path) as source:
            calibration = Calibration.from_json(json.load(source))
    except (OSError, ValueError, KeyError, TypeError, SimulatorStateError):
        return None, None
    if simulator.config.num_features != len(FEATURE_NAMES):
        return None, None
    return simulator, calibration
