"""How far a simulator's ranking can be trusted: rank agreement and the fidelity level.

The three measures compare *predicted* scores (lower = predicted faster) with
*measured* per-iteration times over the same strategies, pair by pair:

* :func:`pairwise_accuracy`: the share of pairs with different measured times
  that the scores order the same way (a tie in score counts as half right).
* :func:`kendall_tau`: Kendall's tau-b rank correlation, which corrects for ties.
* :func:`fidelity_threshold`: AutoStrategy's *fidelity level*, the highest
  score such that among the trials scored at or below it the pairwise accuracy
  is still at least ``accuracy`` (80% by default).

:func:`checked_times` checks measured times for the simulators that learn from them.

Everything is plain numpy, ``O(n^2)`` in time and memory per call: fine for the
few thousand strategies a search scores and compares.
"""
from __future__ import annotations

import math
from typing import Sequence, Tuple, Union

import numpy as np

__all__ = ["checked_times", "fidelity_threshold", "kendall_tau", "pairwise_accuracy"]

ArrayLike = Union[Sequence[float], np.ndarray]


def checked_times(times: ArrayLike, count: int) -> np.ndarray:
    """Measured seconds per iteration of ``count`` strategies, as float64.

    Raises:
        ValueError: when there are not ``count`` of them or one is not a finite number > 0.
    """
    array = np.asarray(times, dtype=np.float64)
    if array.shape != (count,):
        raise ValueError(f"Expected one measured time per sequence ({count}), "
                         f"got shape {array.shape}.")
    if not np.all(np.isfinite(array) & (array > 0)):
        raise ValueError("Every measured time must be a finite number of seconds > 0.")
    return array


def _paired(a: ArrayLike, b: ArrayLike, names: Tuple[str, str]) -> Tuple[np.ndarray, np.ndarray]:
    """Both arrays as finite 1-D float64 arrays of one length, or a ValueError naming them."""
    arrays = []
    for values, name in zip((a, b), names):
        array = np.asarray(values, dtype=np.float64)
        if array.ndim != 1:
            raise ValueError(f"{name} must be one-dimensional, got shape {array.shape}.")
        bad = np.flatnonzero(~np.isfinite(array))
        if bad.size:
            raise ValueError(f"{name}[{bad[0]}] is {float(array[bad[0]])}; every value "
                             "must be finite.")
        arrays.append(array)
    if arrays[0].shape != arrays[1].shape:
        raise ValueError(f"{names[0]} has {arrays[0].size} values but {names[1]} has "
                         f"{arrays[1].size}; they must describe the same strategies.")
    return arrays[0], arrays[1]


def _pair_signs(values: np.ndarray) -> np.ndarray:
    """The ``n x n`` matrix ``sign(values[j] - values[i])``, int8 to stay small for large n."""
    return np.sign(values[None, :] - values[:, None]).astype(np.int8)


def pairwise_accuracy(scores: ArrayLike, measured: ArrayLike) -> float:
    """The share of strategy pairs that the scores rank the same way as the measurements.

    Only pairs with different measured times count (a measured tie has no right
    order). A pair the scores tie counts as half right, so a constant score
    gets 0.5, like a coin.

    Args:
        scores: predicted scores, lower = predicted faster.
        measured: measured per-iteration times of the same strategies.

    Returns:
        float: in [0, 1]; NaN when no pair has different measured times.

    Raises:
        ValueError: the inputs differ in length, are not 1-D or hold a
            non-finite value.
    """
    s, t = _paired(scores, measured, ("scores", "measured"))
    sign_t = _pair_signs(t)
    agree = _pair_signs(s).astype(np.int16) * sign_t
    # Over the full matrix every unordered pair appears twice, which cancels out.
    comparable = np.count_nonzero(sign_t)
    if comparable == 0:
        return math.nan
    right = np.count_nonzero(agree > 0) + 0.5 * np.count_nonzero((agree == 0) & (sign_t != 0))
    return float(right / comparable)


def kendall_tau(a: ArrayLike, b: ArrayLike) -> float:
    """Kendall's tau-b rank correlation between two rankings of the same items.

    ``tau_b = (C - D) / sqrt((P - T_a) (P - T_b))`` with ``C`` and ``D`` the
    concordant and discordant pairs, ``P = n (n - 1) / 2`` all pairs and
    ``T_a``, ``T_b`` the pairs tied in ``a`` and in ``b`` (a pair tied in both
    counts in both).

    Args:
        a: one score per item.
        b: another score per item, e.g. measured times.

    Returns:
        float: in [-1, 1]; NaN when ``a`` or ``b`` is constant (or has fewer
        than two items), as the correlation is then undefined.

    Raises:
        ValueError: the inputs differ in length, are not 1-D or hold a
            non-finite value.
    """
    x, y = _paired(a, b, ("a", "b"))
    n = x.size
    pairs = n * (n - 1) // 2
    sign_x, sign_y = _pair_signs(x), _pair_signs(y)
    # Full matrices count each unordered pair twice; halve every count.
    concordant_minus_discordant = int(np.sum(sign_x.astype(np.int64) * sign_y)) // 2
    tied_x = (np.count_nonzero(sign_x == 0) - n) // 2  # minus the diagonal
    tied_y = (np.count_nonzero(sign_y == 0) - n) // 2
    denominator = math.sqrt(float(pairs - tied_x) * float(pairs - tied_y))
    if denominator == 0.0:
        return math.nan
    return concordant_minus_discordant / denominator


def fidelity_threshold(scores: ArrayLike, measured: ArrayLike, accuracy: float = 0.8) -> float:
    """The fidelity level: the highest score up to which the ranking is still right often enough.

    Sort the trials by score and grow the set of trials scored at or below a
    threshold ``s`` (trials tied in score enter together). The fidelity level is
    the largest trial score ``s`` for which :func:`pairwise_accuracy` over that
    set is at least ``accuracy``. Sets without a pair of different measured
    times carry no evidence and never qualify; the largest qualifying set
    wins even if a smaller one fell short, so one unlucky pair among the first
    two or three trials does not condemn the whole range.

    Args:
        scores: predicted scores of recent trials, lower = predicted faster.
        measured: their measured per-iteration times.
        accuracy: the pairwise accuracy the set must reach, in (0, 1].

    Returns:
        float: the threshold score; ``+inf`` when no pair of trials has
        different measured times (nothing to judge by), ``-inf`` when there is
        evidence but no set reaches ``accuracy``.

    Raises:
        ValueError: as :func:`pairwise_accuracy`, or ``accuracy`` outside (0, 1].
    """
    if not 0.0 < accuracy <= 1.0:
        raise ValueError(f"accuracy must be in (0, 1], got {accuracy!r}.")
    s, t = _paired(scores, measured, ("scores", "measured"))
    order = np.argsort(s, kind="stable")
    s, t = s[order], t[order]
    sign_s, sign_t = _pair_signs(s), _pair_signs(t)
    # Row k against the earlier rows: the pairs that trial k adds to the prefix.
    agree = sign_s.astype(np.int16) * sign_t
    right_added = np.tril((agree > 0) + 0.5 * ((agree == 0) & (sign_t != 0)), k=-1).sum(axis=1)
    comparable_added = np.tril(sign_t != 0, k=-1).sum(axis=1)
    right, comparable = np.cumsum(right_added), np.cumsum(comparable_added)
    if not comparable.size or comparable[-1] == 0:
        return math.inf
    best = -math.inf
    for k in range(s.size):
        if k + 1 < s.size and s[k + 1] == s[k]:
            continue  # the set "score <= s[k]" also holds the tied trials after k
        if comparable[k] > 0 and right[k] >= accuracy * comparable[k] - 1e-12:
            best = float(s[k])
    return best
