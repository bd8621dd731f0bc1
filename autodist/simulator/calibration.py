"""The cost model's component weights, refitted to the trials measured on one cluster.

The default weights (``CostWeights``) come from the benchmark clusters. On the
cluster at hand a component can weigh more or less: on the mlp setting of
``docs/notes/auto_strategy.md`` a serving node cost about half its default and a PS part
about fifteen times its default. The cost model's structure stays; a calibration
multiplies each component's seconds by a factor of its own and adds a constant,
the compute time the model leaves out::

    seconds = cost_model + sum_k (m_k - 1) * component_k + c

``m = 1`` and ``c = 0`` are the cost model itself. :meth:`Calibration.fit` fits
``m >= 0`` and ``c >= 0`` to the measured trials by least squares on relative
errors (a 1.6 s trial should not outweigh twenty 0.5 s ones), with a ridge
penalty pulling every ``m_k`` towards 1 in proportion to how much its component
weighs in the trials, so that a component worth 1% of a step is not held harder
than one worth half of it. A component that makes ``SUPPORT_SHARE`` of the step
in fewer than ``MIN_SUPPORT`` trials keeps its weight: the trials cannot tell
its weight, and a pull in proportion to its tiny share would let the fit give it
any, which strategies where it weighs more then pay for (an embedding search
once set a component present in one trial of 30, at 0.04% of its step, to 146
times its default, predicting 6 s for steps of 90 ms). The penalty's strength is picked by leave-one-out
cross-validation among ``STRENGTHS``, infinity included: no reweighting, only
``c``, which leaves the cost model's ranking as it is. Of the strengths whose
error is within one standard error of the lowest, the strongest is taken (the
"one-standard-error rule"): the lowest of a few noisy errors is low partly by
chance, and a reweighting should have to earn its place. The errors are compared
trial by trial (the standard error of the paired differences), since a trial the
model cannot explain at any strength, such as a strategy whose step time jumps
from run to run, inflates every strength's error alike. A cluster whose trials
agree with the default weights therefore keeps them.

The ranking network (``ranking.py``) then learns what a reweighting cannot
express, on top of the calibrated prediction.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, Sequence

import numpy as np

from autodist.simulator.cost_model import COMPONENTS
from autodist.simulator.features import FEATURE_NAMES, cost_model_seconds
from autodist.simulator.fidelity import checked_times

STRENGTHS = (1e-3, 1e-2, 1e-1, 1.0, 10.0, math.inf)
"""Ridge strengths the cross-validation chooses among; infinity keeps the weights."""
MIN_TRIALS = 8
"""Fewer trials than this fit nothing: the cost model stands as it is."""
SUPPORT_SHARE, MIN_SUPPORT = 0.001, 3
"""A component is refitted only where it makes this share of the step in this many trials."""

_COMPONENT_COLUMNS = [FEATURE_NAMES.index(f"{name}_ms") for name in COMPONENTS]


def component_seconds(features: np.ndarray) -> np.ndarray:
    """Each component's weighted seconds in a strategy's feature sequence, in ``COMPONENTS`` order."""
    return features[:, _COMPONENT_COLUMNS].sum(axis=0, dtype=np.float64) / 1e3


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Per-component multipliers and a constant; see the module docstring.

    Attributes:
        multipliers: component -> factor on its seconds (1 keeps the default weight).
        intercept: seconds added to every prediction.
        strength: the ridge strength cross-validation chose; infinity when the
            weights were kept (or nothing was fitted).
        trials: how many trials it was fitted on.
    """

    multipliers: Dict[str, float] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(COMPONENTS, 1.0))
    intercept: float = 0.0
    strength: float = math.inf
    trials: int = 0

    @property
    def reweighted(self) -> bool:
        """Whether any component's weight differs from the cost model's."""
        return any(m != 1.0 for m in self.multipliers.values())

    def seconds(self, features: np.ndarray) -> float:
        """The calibrated prediction for a strategy's feature sequence; never below 0."""
        base = cost_model_seconds(features)
        if not self.reweighted:
            return base + self.intercept  # exactly the cost model's order
        factors = np.array([self.multipliers[name] for name in COMPONENTS]) - 1.0
        return max(0.0, base + float(component_seconds(features) @ factors) + self.intercept)

    @classmethod
    def fit(cls, features: Sequence[np.ndarray], times: Sequence[float]) -> "Calibration":
        """Fits multipliers and constant to measured trials; see the module docstring.

        Args:
            features: the trials' feature sequences (``strategy_features``).
            times: their measured seconds per iteration, each > 0.

        Returns:
            Calibration: the identity with fewer than ``MIN_TRIALS`` trials.

        Raises:
            ValueError: when the lengths differ or a time is not a finite number > 0.
        """
        y = checked_times(times, len(features))
        if len(y) < MIN_TRIALS:
            return cls(trials=len(y))
        base = np.array([cost_model_seconds(f) for f in features])
        parts = np.stack([component_seconds(f) for f in features])
        # Relative errors: each trial's row is divided by its time.
        target = (y - base) / y
        design = np.column_stack([parts, np.ones(len(y))]) / y[:, None]
        shares = design[:, :-1]
        weight = np.mean(np.square(shares), axis=0)  # each component's share, squared
        unseen = np.sum(np.abs(shares) >= SUPPORT_SHARE, axis=0) < MIN_SUPPORT
        errors = np.array([_loo_errors(design, target, _penalty(weight, s, unseen))
                           for s in STRENGTHS])
        excess = errors - errors[np.argmin(errors.mean(axis=1))]  # per trial, over the lowest
        within = excess.mean(axis=1) <= excess.std(axis=1, ddof=1) / math.sqrt(len(y))
        strength = STRENGTHS[max(np.flatnonzero(within))]
        shift = _solve(design, target, _penalty(weight, strength, unseen))
        return cls(dict(zip(COMPONENTS, (1.0 + shift[:-1]).tolist())), float(shift[-1]),
                   strength, len(y))

    def to_json(self) -> dict:
        return {"multipliers": self.multipliers, "intercept": self.intercept,
                "strength": None if math.isinf(self.strength) else self.strength,
                "trials": self.trials}

    @classmethod
    def from_json(cls, data: dict) -> "Calibration":
        """Reads :meth:`to_json`'s output; a component it lacks keeps its default weight."""
        multipliers = dict.fromkeys(COMPONENTS, 1.0)
        multipliers.update({k: float(v) for k, v in data["multipliers"].items()
                            if k in multipliers})
        strength = data.get("strength")
        return cls(multipliers, float(data["intercept"]),
                   math.inf if strength is None else float(strength), int(data.get("trials", 0)))


def _penalty(weight: np.ndarray, strength: float, held: np.ndarray) -> np.ndarray:
    """The ridge penalty per coordinate: the components' by their weight (infinite for
    those ``held`` at their default), none on the constant."""
    pull = np.full(len(weight), math.inf) if math.isinf(strength) else strength * weight
    return np.append(np.where(held, math.inf, pull), 0.0)


def _lower_bounds(columns: int) -> np.ndarray:
    """Bounds of the solution (multiplier shifts, then the constant): m = 1 + shift >= 0, c >= 0."""
    return np.append(np.full(columns - 1, -1.0), 0.0)


def _solve(design: np.ndarray, target: np.ndarray, penalty: np.ndarray) -> np.ndarray:
    """``argmin |target - design x|^2 + sum(penalty * x^2)`` within the bounds (active set).

    An infinite penalty holds its coordinate at 0. Columns without data and
    without penalty (a component absent from every trial) stay at 0 too.
    """
    columns = design.shape[1]
    lower = _lower_bounds(columns)
    held = np.isinf(penalty) | ((np.abs(design).sum(axis=0) == 0) & (penalty == 0))
    gram = design.T @ design + np.diag(np.where(np.isinf(penalty), 0.0, penalty))
    rhs = design.T @ target
    x = np.zeros(columns)
    at_bound = np.zeros(columns, dtype=bool)
    for _ in range(4 * columns):
        free = ~held & ~at_bound
        x = np.where(at_bound, lower, 0.0)
        if free.any():
            x[free] = np.linalg.lstsq(gram[np.ix_(free, free)],
                                      rhs[free] - gram[np.ix_(free, ~free)] @ x[~free],
                                      rcond=None)[0]
        below = free & (x < lower - 1e-12)
        if below.any():
            # Hold the worst violator at its bound and solve again.
            worst = np.argmax(np.where(below, lower - x, -np.inf))
            at_bound[worst] = True
            continue
        gradient = gram @ x - rhs
        release = at_bound & (gradient < -1e-12)  # moving up from the bound would help
        if not release.any():
            break
        at_bound[np.argmin(np.where(release, gradient, np.inf))] = False
    return np.maximum(x, lower)


def _loo_errors(design: np.ndarray, target: np.ndarray, penalty: np.ndarray) -> np.ndarray:
    """Squared relative error of each trial predicted by a fit on all the others."""
    n = len(target)
    errors = np.empty(n)
    for i in range(n):
        keep = np.arange(n) != i
        x = _solve(design[keep], target[keep], penalty)
        errors[i] = target[i] - design[i] @ x
    return np.square(errors)

