"""The strategy search: sample, score, trust, diversify, measure, learn; repeat.

Each round:

1. the guided sampler draws many candidate strategies (``candidates``);
2. the simulator scores them (lower = predicted faster);
3. candidates scored above the simulator's *fidelity level* are dropped: the
   score up to which its ranking of the measured trials is still at least 80%
   right (before enough trials, nothing is dropped);
4. ``per_round`` trial candidates are picked: a share of the search's trials
   (``explore_share``) is drawn at random among all candidates, the others
   greedily, trading a good score against being unlike every strategy picked
   or tried before;
5. they run for real and their times are recorded;
6. the simulator is retrained on every trial so far: the cost model's component
   weights are refitted to them (``calibration.py``), and the ranking network
   learns, on top of that calibrated prediction, what a reweighting misses.

The random picks are there for the simulator: it learns from the trials, and
the trials of its own favourites only teach it about strategies like them, so
it ranks the rest of the space no better, or worse, than the cost model did.

The search ends when the trial budget is spent and returns the fastest
strategy measured. The hand-written builders can open the search as trials:
they anchor the simulator on strategies known to be sensible, set the bar that
the *hit rate* counts against, and make sure the result is never worse than
the best of them.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import types
from typing import Any, Callable, Collection, Dict, List, Optional, Sequence

import numpy as np

from autodist.resource_spec import ResourceSpec
from autodist.simulator.calibration import MIN_TRIALS as MIN_TRIALS_FOR_CALIBRATION
from autodist.simulator.calibration import Calibration
from autodist.simulator.features import FEATURE_NAMES, cost_model_seconds, strategy_features
from autodist.simulator.fidelity import fidelity_threshold
from autodist.simulator.ranking import RankingSimulator
from autodist.search.sampler import SamplerConstraints, StrategySampler
from autodist.search.trial import TrialResult
from autodist.strategy.base import Strategy, StrategyError
from autodist.strategy.compiler import NodeMemoryError, compile_strategy

FIDELITY_ACCURACY = 0.8
MIN_TRIALS_FOR_FIDELITY = 4
RECENT_TRIALS = 16
DIVERSITY_WEIGHT = 0.5
EXPLORE_SHARE = 0.25
# Columns that say how a variable is synchronized: what diversity compares.
_CHOICE_COLUMNS = [FEATURE_NAMES.index(name) for name in
                   ("ps_share", "proxy_share", "log2_parts", "fp16_share", "log_shared_parts")]

Measure = Callable[[Strategy], TrialResult]


@dataclasses.dataclass
class TrialRecord:
    """One measured strategy.

    Attributes:
        index: 1-based position among the trials.
        strategy: what ran.
        source: ``"builder:<name>"``, ``"search"`` (picked by score and diversity)
            or ``"explore"`` (picked at random).
        predicted: the simulator's score before the trial ran.
        cost_model: the cost model's seconds for it.
        result: the measurement.
    """

    index: int
    strategy: Strategy
    source: str
    predicted: float
    cost_model: float
    result: TrialResult
    features: Optional[np.ndarray] = dataclasses.field(repr=False, default=None)

    def to_json(self) -> dict:
        return {"trial": self.index, "strategy_id": self.strategy.id, "source": self.source,
                "predicted_s": self.predicted, "cost_model_s": self.cost_model,
                "measured_s": self.result.seconds_per_step, "error": self.result.error,
                "wall_s": round(self.result.wall_seconds, 2)}


@dataclasses.dataclass
class SearchResult:
    """The outcome: the fastest measured strategy and the whole record."""

    best: Strategy
    best_seconds: Optional[float]
    trials: List[TrialRecord]
    baseline_seconds: Optional[float]   # the best hand-written builder's time
    simulator: RankingSimulator
    calibration: Calibration = dataclasses.field(default_factory=Calibration)
    plot_path: Optional[str] = None  # search.png, once drawn
    plot_skipped: bool = False  # a Ctrl-C came before the plot was drawn
    interrupted: bool = False  # Ctrl-C ended it early: ``best`` is the best so far

    @property
    def hit_rate(self) -> Optional[float]:
        """Share of the search's own trials faster than the best hand-written builder."""
        searched = [t for t in self.trials if _searched(t)]
        if self.baseline_seconds is None or not searched:
            return None
        return sum(map(self.is_hit, searched)) / len(searched)

    def is_hit(self, entry: "TrialRecord") -> bool:
        """Whether a trial beat the best hand-written builder."""
        return bool(entry.result.ok and self.baseline_seconds is not None
                    and entry.result.seconds_per_step < self.baseline_seconds)


class StrategySearch:
    """Searches strategies for one graph on one cluster.

    Args:
        variables: a ``GraphItem``, ``CapturedGraph`` or list of ``VariableInfo``.
        resource_spec: the cluster.
        batch_size: examples per replica and step (for the sparse traffic estimate).
        constraints: what the sampler may choose.
        candidates: strategies sampled per round.
        per_round: trials per round.
        explore_share: share of the search's trials picked at random among the
            candidates rather than by score.
        seed: seed of the sampler.
        simulator: a simulator to continue from; a fresh one starting from the
            cost model if None. Its prior becomes the calibrated cost model.
        calibration: the cost model's calibration to continue from (saved with
            ``simulator``); the cost model as it is if None.
    """

    def __init__(self, variables: Any, resource_spec: ResourceSpec, *, batch_size: int = 32,
                 constraints: SamplerConstraints = SamplerConstraints(), candidates: int = 2000,
                 per_round: int = 4, explore_share: float = EXPLORE_SHARE, seed: int = 0,
                 simulator: Optional[RankingSimulator] = None,
                 calibration: Optional[Calibration] = None):
        if not 0.0 <= explore_share <= 1.0:
            raise ValueError(f"explore_share must be within [0, 1], got {explore_share!r}.")
        self._variables = list(getattr(variables, "trainable_variables", variables))
        # What the compiler reads of a graph (a capture or a GraphItem; a plain list of
        # variables sums over no replicas).
        self._graph = types.SimpleNamespace(
            trainable_variables=self._variables,
            sums_over_replicas=getattr(variables, "sums_over_replicas", False))
        # Nodes given a memory: strategies whose training state a node cannot hold are
        # never measured nor picked (the compiler would refuse them).
        self._capped = any(node.memory is not None for node in resource_spec.nodes)
        # A graph trained with gradient accumulation syncs once per cycle of runs.
        self._accumulation_steps = getattr(variables, "accumulation_steps", 1)
        self._spec = resource_spec
        self._batch_size = batch_size
        self._sampler = StrategySampler(self._variables, resource_spec, constraints)
        self._candidates = candidates
        self._per_round = per_round
        self._explore_share = explore_share
        self._seed = seed
        self.calibration = calibration or Calibration()
        self.simulator = simulator or RankingSimulator(len(FEATURE_NAMES), seed=seed,
                                                       use_prior=True)
        # The prior is looked up at every call, so it follows each refit of the calibration.
        self.simulator.prior = lambda features: self.calibration.seconds(features)

    def features(self, strategy: Strategy) -> np.ndarray:
        return strategy_features(strategy, self._variables, self._spec,
                                 batch_size=self._batch_size,
                                 accumulation_steps=self._accumulation_steps)

    def fits(self, strategy: Strategy) -> bool:
        """Whether every node's ``memory`` holds what ``strategy`` stores there."""
        if not self._capped:
            return True
        try:
            compile_strategy(strategy, self._graph, self._spec)
        except NodeMemoryError:
            return False
        except StrategyError:
            return True  # another fault, which its trial reports as before
        return True

    def _nothing_fits(self) -> NodeMemoryError:
        return NodeMemoryError(
            f"None of the {self._candidates} strategies sampled, nor a builder's, fits the "
            f"nodes' memory in the resource spec {self._spec.source!r}; give the nodes more "
            "memory, or build a strategy that partitions the large variables (PartitionedPS).")

    def best_predicted(self) -> Strategy:
        """The candidate the simulator likes best, with no trial at all.

        Raises:
            NodeMemoryError: when no candidate fits the nodes' memory.
        """
        candidates = self.candidates(0)
        if not candidates:
            raise self._nothing_fits()
        scores = self.simulator.score([self.features(c) for c in candidates])
        return candidates[int(np.argmin(scores))]

    def run(self, measure: Measure, trials: int, builders: Optional[Dict[str, Strategy]] = None,
            on_trial: Optional[Callable[[TrialRecord, "SearchResult"], None]] = None
            ) -> SearchResult:
        """Spends ``trials`` measurements; returns the fastest strategy measured.

        Args:
            measure: runs a strategy for real.
            trials: the budget, builder trials included.
            builders: hand-written strategies (name -> strategy) to measure first,
                those the cost model predicts fastest first, within half the budget
                (but at least one).
            on_trial: called after every trial (progress, logs).

        Returns:
            the result; after a Ctrl-C (``KeyboardInterrupt``) once a trial has
            succeeded, the best so far, marked ``interrupted``.

        Raises:
            RuntimeError: when every trial failed.
            NodeMemoryError: when no strategy fits the nodes' memory.
            KeyboardInterrupt: on a Ctrl-C before any trial succeeded.
        """
        records: List[TrialRecord] = []
        result = SearchResult(None, None, records, None, self.simulator, self.calibration)

        def record(strategy, source, predicted, features):
            outcome = measure(strategy)
            entry = TrialRecord(len(records) + 1, strategy, source, predicted,
                                cost_model_seconds(features), outcome, features)
            records.append(entry)
            _update(result, entry)
            if on_trial is not None:
                on_trial(entry, result)

        try:
            self._run_trials(record, records, trials, builders)
        except KeyboardInterrupt:
            if result.best is None:
                raise
            result.interrupted = True
        if not records and self._capped:
            raise self._nothing_fits()
        result.calibration = self.calibration
        if result.best is None:
            raise RuntimeError(f"Every one of the {len(records)} trials failed; the first: "
                               f"{records[0].result.error if records else 'none ran'}")
        return result

    def _run_trials(self, record: Callable, records: List[TrialRecord], trials: int,
                    builders: Optional[dict]) -> None:
        """The builders' trials, then the search's rounds, until ``trials`` ran."""
        # The builders the cost model likes best open, within half the budget.
        seeds = sorted(((self.features(s), name, s) for name, s in (builders or {}).items()
                        if self.fits(s)), key=lambda seed: cost_model_seconds(seed[0]))
        for features, name, strategy in seeds[:max(1, trials // 2)]:
            record(strategy, f"builder:{name}", float(self.simulator.score([features])[0]),
                   features)
        self._retrain(records)  # the first round already learns from the builders' trials
        round_index = 0
        while len(records) < trials:
            picks = self._pick(round_index, records, min(self._per_round, trials - len(records)))
            round_index += 1
            if not picks:
                break  # a small model: every strategy the sampler draws was tried
            for strategy, source, score, features in picks:
                record(strategy, source, score, features)
            self._retrain(records)

    def candidates(self, round_index: int, exclude: Collection[str] = ()) -> List[Strategy]:
        """A round's samples that fit the nodes' memory, without duplicates and without
        the strategy ids ``exclude``."""
        unique = {}
        for strategy in self._sampler.sample_many(self._candidates,
                                                  seed=self._seed * 100_003 + round_index):
            if strategy.id not in exclude and strategy.id not in unique and self.fits(strategy):
                unique[strategy.id] = strategy
        return list(unique.values())

    def _pick(self, round_index: int, records: List[TrialRecord], count: int) -> list:
        """``count`` (strategy, source, score, features) to try next, random picks first."""
        candidates = self.candidates(round_index, {r.strategy.id for r in records})
        if not candidates:
            return []
        features = [self.features(c) for c in candidates]
        scores = self.simulator.score(features)
        # Random picks keep to their share of the search's trials, this round's included.
        searched = [r for r in records if _searched(r)]
        explored = sum(r.source == "explore" for r in searched)
        due = round(self._explore_share * (len(searched) + count)) - explored
        rng = np.random.default_rng([self._seed, round_index])
        explore = rng.choice(len(candidates), size=min(max(due, 0), count, len(candidates)),
                             replace=False)
        picks = [(candidates[i], "explore", float(scores[i]), features[i]) for i in explore]
        count -= len(picks)
        keep = np.setdiff1d(np.arange(len(candidates)), explore)
        measured = [r for r in records if r.result.ok]
        if len(measured) >= MIN_TRIALS_FOR_FIDELITY:
            # Judged on scores given before each trial was measured: scores after
            # training on the trials would flatter the simulator.
            recent = measured[-RECENT_TRIALS:]
            level = fidelity_threshold([r.predicted for r in recent],
                                       [r.result.seconds_per_step for r in recent],
                                       FIDELITY_ACCURACY)
            trusted = keep[scores[keep] <= level]
            # Where the simulator is trusted nowhere, its best guesses still beat chance.
            keep = (trusted if trusted.size >= count
                    else keep[np.argsort(scores[keep], kind="stable")[:max(count, 1)]])
        if not count or not keep.size:
            return picks
        signatures = np.stack([_signature(features[i]) for i in keep])
        closest = np.ones(len(keep))  # distance to the nearest strategy picked or tried
        for other in [entry.features for entry in records] + [p[3] for p in picks]:
            closest = np.minimum(closest, _distances(signatures, _signature(other)))
        rank = np.empty(len(keep))
        rank[np.argsort(scores[keep], kind="stable")] = np.arange(len(keep)) / len(keep)
        for _ in range(min(count, len(keep))):
            best = int(np.argmax(-rank + DIVERSITY_WEIGHT * closest))
            chosen = keep[best]
            picks.append((candidates[chosen], "search", float(scores[chosen]), features[chosen]))
            closest = np.minimum(closest, _distances(signatures, signatures[best]))
            rank[best] = np.inf  # never twice
        return picks

    def _retrain(self, records: List[TrialRecord]) -> None:
        measured = [r for r in records if r.result.ok]
        times = [r.result.seconds_per_step for r in measured]
        if len(measured) < 2 or max(times) <= min(times) * 1.01:
            return  # nothing to learn a ranking from yet
        features = [r.features for r in measured]
        if len(measured) >= MIN_TRIALS_FOR_CALIBRATION:  # else the one it started with stands
            self.calibration = Calibration.fit(features, times)
        self.simulator.fit(features, times)


def _update(result: SearchResult, entry: TrialRecord) -> None:
    seconds = entry.result.seconds_per_step
    if seconds is None:
        return
    if result.best_seconds is None or seconds < result.best_seconds:
        result.best, result.best_seconds = entry.strategy, seconds
    if entry.source.startswith("builder:") and (result.baseline_seconds is None
                                                or seconds < result.baseline_seconds):
        result.baseline_seconds = seconds


def _searched(entry: TrialRecord) -> bool:
    """Whether the search picked the trial (at random or by score), not a builder opening it."""
    return not entry.source.startswith("builder:")


def _signature(features: np.ndarray) -> np.ndarray:
    """How a strategy synchronizes each variable, flattened (one row per variable)."""
    return features[:, _CHOICE_COLUMNS].ravel()


def _distances(signatures: np.ndarray, other: np.ndarray) -> np.ndarray:
    """How differently each strategy of ``signatures`` synchronizes than ``other``, 0 to 1."""
    return np.mean(np.minimum(np.abs(signatures - other), 1.0), axis=1)


def write_log(path: str, records: Sequence[TrialRecord]) -> None:
    """The JSONL log of every trial."""
    with open(path, "w") as log:
        for entry in records:
            log.write(json.dumps(entry.to_json()) + "\n")


def plot(path: str, result: SearchResult) -> Optional[str]:
    """Best time so far and hit rate against trials, as a PNG; None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    index, best, hits = [], [], []
    best_so_far, searched, hit = math.inf, 0, 0
    for entry in result.trials:
        if entry.result.ok:
            best_so_far = min(best_so_far, entry.result.seconds_per_step)
        if _searched(entry):
            searched += 1
            hit += result.is_hit(entry)
        index.append(entry.index)
        best.append(1e3 * best_so_far if math.isfinite(best_so_far) else np.nan)
        hits.append(hit / searched if searched and result.baseline_seconds else np.nan)
    figure, left = plt.subplots(figsize=(6.4, 3.6))
    left.plot(index, best, marker="o", color="tab:blue", label="best so far")
    if result.baseline_seconds is not None:
        left.axhline(1e3 * result.baseline_seconds, color="tab:gray", linestyle="--",
                     label="best hand-written builder")
    left.set_xlabel("trial")
    left.set_ylabel("time per step (ms)")
    # From zero and without an offset, so that a gain of a fraction of a percent looks like one.
    left.set_ylim(0, 1.2 * max(left.get_ylim()[1], 1e-3))
    left.ticklabel_format(axis="y", useOffset=False)
    right = left.twinx()
    right.plot(index, hits, color="tab:orange", label="hit rate")
    right.set_ylabel("hit rate")
    right.set_ylim(0, 1)
    lines = left.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    left.legend(lines[0] + more[0], lines[1] + more[1], loc="center right", fontsize="small")
    figure.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
