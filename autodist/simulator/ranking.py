"""A learned simulator: a small RNN that ranks strategies, refined by measured trials.

A strategy reaches the simulator as a *sequence* of per-variable feature
vectors, a float array ``[num_variables, num_features]`` whose length varies
from strategy to strategy (partitioning adds rows). Which numbers go in is
decided by the caller; the simulator only assumes they are finite floats.

Usage::

    sim = RankingSimulator(num_features=16, prior=cost_model_seconds)
    sim.score(candidates)              # zero trials: the prior's own prediction
    history = sim.fit(trial_sequences, measured_seconds)   # all trials so far
    sim.score(candidates)              # refined; lower = predicted faster
    sim.save("bert_4nodes.ranker.npz")
    sim = RankingSimulator.load("bert_4nodes.ranker.npz", prior=cost_model_seconds)

Public API: :class:`RankingSimulator` (``score``, ``log_scores``, ``fit``,
``fit_normalization``, ``save``, ``load``), :class:`RankingConfig`,
:class:`SimulatorStateError`, ``CORRECTION_SCALES``; the rank measures and the fidelity level
(``pairwise_accuracy``, ``kendall_tau``, ``fidelity_threshold``) are in
``fidelity.py``.

Scores are predicted seconds per iteration: ``exp(log_score)`` with

    log_score = offset + prior_weight * log(prior + 1e-6)
                + correction_scale * correction(sequence)

How it starts from the cost model. The prior (a callable giving the cost
model's prediction for a sequence, or the values themselves passed as
``prior_values``) enters the score as a residual: the network only learns a
correction in log-time, and its output layer starts at zero, so with no trial
the ranking *is* the prior's, exactly, and scoring costs no network pass. The
alternative, pre-training the network to imitate the cost model on sampled
strategies, would spend seconds per search on imitation, reproduce the prior
only approximately, and forget it wherever trials pull the weights. With the
residual, trials bend the prior where they disagree with it; ``prior_weight``
(trainable, starting at 1) rescales it when the cost model over- or
under-states differences (for instance because it leaves out compute time),
and the L2 penalty on the network's kernels pulls the correction back to zero,
i.e. towards the prior, where trials say nothing.

How much to trust. A correction learned from a few dozen trials can rank
strategies it never saw worse than the cost model alone: in the benchmark
searches of ``docs/notes/auto_strategy.md``, the simulator's scores given before each
trial ranked the trials worse than the cost model's did on all three settings.
So, with a prior, every fit also cross-validates: the trials are split into
``validation_folds`` folds, a model is trained from the initial weights on all
folds but one and scores the one it did not see, and the share of the
correction the scores keep (``correction_scale``, one of
``CORRECTION_SCALES``: 0 is the cost model's ranking, 1 the whole correction)
is the one whose held-out pairs come out in the measured order most often,
each pair weighted by how sure its order is (``|2P - 1|``, so measurement
noise decides little). That costs ``validation_folds`` extra trainings per fit.

The network (``ranking_net.py`` explains its design). A dense encoder per
variable feeds a GRU over blocks of consecutive variables and, beside it, a
masked sum over all variables; two heads, both starting at zero, add up to the
correction. Padding and masking let one batch hold strategies of any lengths;
the input normalization is fitted on the first training data (or by
:meth:`RankingSimulator.fit_normalization`) and saved with the weights.

The loss. For every pair of trials, ``P * softplus(-m) + (1 - P) * softplus(m)``
with ``m = (s_j - s_i) / temperature`` (``s`` the log-scores) and the target
``P = sigmoid((log t_j - log t_i) / temperature)`` the chance that ``t_i < t_j``
(a logistic pairwise loss, RankNet with soft targets: pairs apart by a few
temperatures count as certain, near-ties, which are measurement noise, ask
for no order), averaged over pairs; plus a small squared error between ``s``
and ``log t`` that keeps scores in seconds, plus L2. Soft targets ranked
held-out strategies better than hard ones during development (mean tau 0.69
against 0.65 without prior, 0.91 against 0.83 with one, same synthetic data).
Training is full-batch (up to ``batch_size`` trials) with Adam in a
``tf.function``: 300 epochs on 30 strategies of 60 variables take about 5 s
here, plus 2-3 s of tracing on a simulator's first fit.

Graph mode. The rest of AutoDist builds ``tf.compat.v1`` graphs inside
``tf.Graph().as_default()`` blocks. Every TensorFlow call here runs eagerly; when
called from inside such a block (the graph stack is thread-local) the work runs
on a short-lived helper thread, which starts with no default graph. Nothing
global is changed: no ``disable_eager_execution``, no Keras session or seed.

Note:
    The network is written with TensorFlow ops and needs Keras' TensorFlow
    backend (the default, and the only one AutoDist installs).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import keras
import numpy as np
import tensorflow as tf

from autodist.simulator.fidelity import checked_times, kendall_tau, pairwise_accuracy
from autodist.simulator.ranking_net import Normalization, ScoreNet
from autodist.simulator.ranking_state import SimulatorStateError, read_state, write_state

__all__ = ["CORRECTION_SCALES", "RankingConfig", "RankingSimulator", "SimulatorStateError"]

Prior = Callable[[np.ndarray], float]

_PRIOR_FLOOR = 1e-6  # seconds; keeps log() finite for a strategy the prior calls free
_SCORE_BATCH = 256
CORRECTION_SCALES = (0.0, 0.25, 0.5, 0.75, 1.0)
"""The shares of the learned correction that cross-validation chooses among."""


@dataclasses.dataclass(frozen=True)
class _Training:
    """How one fit trains (its arguments, for every model it trains)."""

    epochs: int
    learning_rate: float
    batch_size: int
    hyper: List[np.float32]  # anchor weight, temperature, l2, rnn_l2: _train_step's scalars


@dataclasses.dataclass(frozen=True)
class RankingConfig:
    """What defines a simulator's architecture; saved with its weights.

    Attributes:
        num_features: columns of every per-variable feature array.
        units: width of the encoder, the GRU and the head.
        max_steps: most GRU steps; longer sequences are pooled in blocks.
        log_columns: columns put through ``log1p`` before standardization
            (byte counts); None picks, at normalization time, the columns
            that are never negative and reach 1024.
        use_prior: the score has the prior term.
        seed: seed of the weight initializers and of batch shuffling.
    """

    num_features: int
    units: int = 16
    max_steps: int = 32
    log_columns: Optional[Tuple[int, ...]] = None
    use_prior: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_features", "units", "max_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"RankingConfig.{name} must be a positive integer, got {value!r}.")
        if self.log_columns is not None:
            bad = [c for c in self.log_columns if not 0 <= c < self.num_features]
            if bad:
                raise ValueError(f"RankingConfig.log_columns {bad} are outside "
                                 f"[0, {self.num_features}).")


def _run_eagerly(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Calls ``fn`` where TensorFlow executes eagerly, off the caller's default graph."""
    if tf.executing_eagerly():
        return fn(*args, **kwargs)
    # A v1 graph (or a tf.function trace) is the default in this thread only; a
    # new thread starts eager with no default graph.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn, *args, **kwargs).result()


class RankingSimulator:
    """Scores strategies from per-variable feature sequences; see the module docstring.

    Args:
        num_features: columns of every feature array.
        prior: the cost model's predicted seconds for a sequence; None for none.
        units: width of the network.
        seed: seed of initialization and shuffling (same seed, same weights).
        max_steps: most GRU steps per sequence.
        log_columns: columns to ``log1p``; None to detect byte-like columns.
        use_prior: whether the score has the prior term; defaults to whether
            ``prior`` is given. With True and no callable, every call must pass
            ``prior_values``.

    Raises:
        ValueError: a bad size or column, or Keras not on its TensorFlow backend.
    """

    def __init__(self, num_features: int, prior: Optional[Prior] = None, units: int = 16,
                 seed: int = 0, *, max_steps: int = 32,
                 log_columns: Optional[Sequence[int]] = None,
                 use_prior: Optional[bool] = None):
        if keras.backend.backend() != "tensorflow":
            raise ValueError("RankingSimulator needs Keras' TensorFlow backend, but "
                             f"KERAS_BACKEND is {keras.backend.backend()!r}.")
        config = RankingConfig(
            num_features=num_features, units=units, max_steps=max_steps,
            log_columns=None if log_columns is None else tuple(int(c) for c in log_columns),
            use_prior=prior is not None if use_prior is None else bool(use_prior), seed=seed)
        self.config = config
        self.prior = prior
        self.normalization: Optional[Normalization] = None
        self.trained = False
        self.correction_scale = 1.0
        self._fits = 0
        _run_eagerly(self._build)

    def __repr__(self) -> str:
        return (f"RankingSimulator(num_features={self.config.num_features}, "
                f"units={self.config.units}, use_prior={self.config.use_prior}, "
                f"trained={self.trained})")

    def _build(self) -> None:
        f = 2 * self.config.num_features  # see Normalization: normalized + linear copies
        self._net = ScoreNet(self.config.units, self.config.use_prior, self.config.seed)
        # Build every weight now: variables created during a tf.function trace
        # would tie them to that trace.
        self._net(tf.zeros([1, 1, f]), tf.ones([1, 1], tf.bool), tf.zeros([1]),
                  tf.constant(1), tf.constant(1.0), tf.constant(1.0))
        self._optimizer = keras.optimizers.Adam(learning_rate=3e-3, name="ranking_adam")
        self._optimizer.build(self._net.trainable_variables)
        # Cross-validation trains fold models from here (see _validate_correction).
        self._initial_state = self._snapshot()
        spec = [tf.TensorSpec([None, None, f], tf.float32), tf.TensorSpec([None, None], tf.bool),
                tf.TensorSpec([None], tf.float32), tf.TensorSpec([], tf.int32),
                tf.TensorSpec([], tf.float32)]
        self._score_fn = tf.function(self._net.call,
                                     input_signature=spec + [tf.TensorSpec([], tf.float32)])
        self._train_fn = tf.function(self._train_steps, input_signature=[
            tf.TensorSpec([], tf.int32)] + spec + [
            tf.TensorSpec([None], tf.float32), tf.TensorSpec([None, None], tf.float32),
            tf.TensorSpec([None, None], tf.float32)] + [tf.TensorSpec([], tf.float32)] * 4)

    def _snapshot(self) -> List[np.ndarray]:
        """The network's weights and the optimizer's state, as arrays."""
        return [np.array(v.numpy()) for v in self._net.weights + self._optimizer.variables]

    def _restore(self, snapshot: List[np.ndarray]) -> None:
        for variable, value in zip(self._net.weights + self._optimizer.variables, snapshot):
            variable.assign(value)

    # ----------------------------------------------------------------- inputs

    def _check_sequences(self, sequences: Sequence[np.ndarray]) -> List[np.ndarray]:
        out = []
        for i, seq in enumerate(sequences):
            array = np.asarray(seq, dtype=np.float64)
            if array.ndim != 2 or array.shape[0] < 1 or array.shape[1] != self.config.num_features:
                raise ValueError(f"sequences[{i}] has shape {array.shape}; expected "
                                 f"[num_variables >= 1, {self.config.num_features}].")
            if not np.all(np.isfinite(array)):
                raise ValueError(f"sequences[{i}] holds a non-finite value.")
            out.append(array)
        return out

    def _log_priors(self, sequences: List[np.ndarray],
                    prior_values: Optional[Sequence[float]]) -> np.ndarray:
        if not self.config.use_prior:
            if prior_values is not None:
                raise ValueError("prior_values were given, but this RankingSimulator was built "
                                 "without a prior (use_prior=False).")
            return np.zeros(len(sequences))
        if prior_values is None:
            if self.prior is None:
                raise ValueError("This RankingSimulator scores with a prior, but has no prior "
                                 "callable: pass prior_values, or prior= to the constructor "
                                 "or to load().")
            prior_values = [self.prior(seq) for seq in sequences]
        values = np.asarray(prior_values, dtype=np.float64)
        if values.shape != (len(sequences),):
            raise ValueError(f"Expected one prior value per sequence ({len(sequences)}), "
                             f"got shape {values.shape}.")
        bad = np.flatnonzero(~np.isfinite(values) | (values < 0))
        if bad.size:
            raise ValueError(f"Prior value {float(values[bad[0]])} of sequence {bad[0]} is not a "
                             "finite non-negative number of seconds.")
        return np.log(values + _PRIOR_FLOOR)

    def _pad(self, sequences: List[np.ndarray]) -> Tuple[np.ndarray, np.ndarray]:
        """Network input ``[B, T, 2F]`` (zero-padded) and mask ``[B, T]``, T a stride multiple."""
        norm = self.normalization
        stride = norm.stride
        longest = max(len(seq) for seq in sequences)
        length = -(-longest // stride) * stride
        x = np.zeros((len(sequences), length, 2 * self.config.num_features), np.float32)
        mask = np.zeros((len(sequences), length), bool)
        for i, seq in enumerate(sequences):
            x[i, :len(seq)] = norm.apply(seq)
            mask[i, :len(seq)] = True
        return x, mask

    # ---------------------------------------------------------------- scoring

    def fit_normalization(self, sequences: Sequence[np.ndarray]) -> None:
        """Fits the input normalization (and the pooling stride) on ``sequences``.

        :meth:`fit` calls this on its first training data when it has not been
        called; call it earlier on a large sample of candidates for steadier
        statistics. Calling it again after training changes what the trained
        weights see, so retrain afterwards.

        Args:
            sequences: feature arrays ``[num_variables, num_features]``.

        Raises:
            ValueError: a malformed or empty ``sequences``.
        """
        checked = self._check_sequences(sequences)
        if not checked:
            raise ValueError("fit_normalization needs at least one sequence.")
        self.normalization = Normalization.fit(checked, self.config.log_columns,
                                               self.config.max_steps)

    def log_scores(self, sequences: Sequence[np.ndarray],
                   prior_values: Optional[Sequence[float]] = None) -> np.ndarray:
        """Predicted natural log of seconds per iteration, one per sequence.

        Args and Raises: as :meth:`score`.

        Returns:
            np.ndarray: float64, shape ``[len(sequences)]``.
        """
        checked = self._check_sequences(sequences)
        log_prior = self._log_priors(checked, prior_values)
        if not checked:
            return np.zeros(0)
        return _run_eagerly(self._log_scores, checked, log_prior)

    def _log_scores(self, sequences: List[np.ndarray], log_prior: np.ndarray,
                    correction_scale: Optional[float] = None) -> np.ndarray:
        weight, offset = float(self._net.prior_weight.numpy()), float(self._net.offset.numpy())
        if not self.trained:
            # The head starts at zero, so the network's correction is exactly 0.
            return offset + weight * log_prior
        out = np.empty(len(sequences))
        # Sorting by length makes each padded batch nearly rectangular.
        order = np.argsort([len(seq) for seq in sequences], kind="stable")
        norm = self.normalization
        scale = np.float32(self.correction_scale if correction_scale is None else correction_scale)
        for start in range(0, len(order), _SCORE_BATCH):
            idx = order[start:start + _SCORE_BATCH]
            x, mask = self._pad([sequences[i] for i in idx])
            out[idx] = self._score_fn(x, mask, log_prior[idx].astype(np.float32),
                                      np.int32(norm.stride), np.float32(norm.sum_scale),
                                      scale).numpy()
        return out

    def score(self, sequences: Sequence[np.ndarray],
              prior_values: Optional[Sequence[float]] = None) -> np.ndarray:
        """Predicted seconds per iteration; lower = predicted faster.

        Args:
            sequences: feature arrays ``[num_variables, num_features]``, any lengths.
            prior_values: the prior's predictions for these sequences, in
                place of calling the prior; only with a prior.

        Returns:
            np.ndarray: float64, shape ``[len(sequences)]``, all positive.

        Raises:
            ValueError: a malformed sequence or prior value, or a prior needed
                and missing.
        """
        return np.exp(self.log_scores(sequences, prior_values))

    # --------------------------------------------------------------- training

    def _train_step(self, x, mask, log_prior, stride, sum_scale, log_time, pair_weight,
                    pair_target, anchor_weight, temperature, l2, rnn_l2):
        variables = self._net.trainable_variables
        with tf.GradientTape() as tape:
            s = self._net(x, mask, log_prior, stride, sum_scale, tf.constant(1.0), training=True)
            # margin[i, j] = s_j - s_i; pair_target[i, j] is how likely t_i < t_j.
            margin = (s[None, :] - s[:, None]) / temperature
            pair_loss = (pair_target * tf.nn.softplus(-margin)
                         + (1.0 - pair_target) * tf.nn.softplus(margin))
            rank_loss = (tf.reduce_sum(pair_weight * pair_loss)
                         / tf.maximum(tf.reduce_sum(pair_weight), 1.0))
            anchor = tf.reduce_mean(tf.square(s - log_time))
            pooled_kernels, rnn_kernels = self._net.kernels()
            penalty = (l2 * tf.add_n([tf.reduce_sum(tf.square(k)) for k in pooled_kernels])
                       + rnn_l2 * tf.add_n([tf.reduce_sum(tf.square(k)) for k in rnn_kernels]))
            loss = rank_loss + anchor_weight * anchor + penalty
        self._optimizer.apply(tape.gradient(loss, variables), variables)
        return loss

    def _train_steps(self, repeats, *batch):
        """``repeats`` training steps on one batch (``_train_step``'s arguments); their losses."""
        losses = tf.TensorArray(tf.float32, size=repeats)
        for i in tf.range(repeats):
            losses = losses.write(i, self._train_step(*batch))
        return losses.stack()

    def fit(self, sequences: Sequence[np.ndarray], measured_times: Sequence[float], *,
            prior_values: Optional[Sequence[float]] = None, epochs: int = 300,
            learning_rate: float = 3e-3, temperature: float = 0.1, anchor_weight: float = 0.1,
            l2: float = 1e-2, rnn_l2: float = 1e-1, batch_size: int = 64,
            validation_folds: int = 3) -> Dict[str, Any]:
        """Trains on measured trials with the pairwise ranking loss; see the module docstring.

        Training continues from the current weights (and Adam state), so call
        it with all trials so far each time new ones come in. With a prior,
        ``validation_folds`` fold models then decide how much of the learned
        correction the scores keep (module docstring, "How much to trust").

        Args:
            sequences: feature arrays of the measured strategies.
            measured_times: their measured seconds per iteration.
            prior_values: the prior's predictions for them, in place of the callable.
            epochs: passes over the trials.
            learning_rate: Adam's step size.
            temperature: log-time difference that counts as one logit in the
                pairwise loss; about the spread of times worth telling apart.
            anchor_weight: weight of the squared error between log-score and
                log-time (calibration); 0 for a pure ranking loss.
            l2: L2 penalty on the pooled branch's kernels (pulls towards the prior).
            rnn_l2: L2 penalty on the recurrent branch's kernels.
            batch_size: trials per step; more trials are split into shuffled batches.
            validation_folds: folds of the cross-validation that picks the
                correction scale; 0 keeps the whole correction. Needs a prior
                and two trials per fold, else the whole correction is kept.

        Returns:
            dict: ``epochs``, ``seconds`` (wall time), ``loss`` (mean loss per
            epoch, list), ``pairwise_accuracy`` and ``kendall_tau`` on the
            training trials after training, ``correction_scale`` (the share of
            the correction kept) and ``validation_accuracy`` (correction scale
            -> the fold models' weighted pairwise accuracy on their held-out
            trials; empty without cross-validation).

        Raises:
            ValueError: malformed inputs, or no two trials with different times.
        """
        checked = self._check_sequences(sequences)
        times = checked_times(measured_times, len(checked))
        if epochs < 1 or batch_size < 2 or temperature <= 0:
            raise ValueError(f"Need epochs >= 1, batch_size >= 2 and temperature > 0; got "
                             f"{epochs}, {batch_size} and {temperature}.")
        if validation_folds < 0 or validation_folds == 1:
            raise ValueError(f"validation_folds must be 0 (off) or at least 2, got "
                             f"{validation_folds}.")
        log_time = np.log(times)
        if np.ptp(log_time) == 0:
            raise ValueError(f"fit needs two trials with different measured times; got "
                             f"{len(checked)} trial(s).")
        # How likely t_i < t_j, given times that differ by `temperature` in log are
        # worth one logit: near-ties (measurement noise) pull margins to ~0
        # instead of being forced apart.
        gap = log_time[None, :] - log_time[:, None]
        target = 0.5 * (1.0 + np.tanh(0.5 * gap / temperature))  # sigmoid, overflow-free
        log_prior = self._log_priors(checked, prior_values)
        if self.normalization is None:
            self.fit_normalization(checked)
        if not self.config.use_prior or len(checked) < 2 * validation_folds:
            validation_folds = 0
        training = _Training(epochs, learning_rate, batch_size,
                             [np.float32(v) for v in (anchor_weight, temperature, l2, rnn_l2)])
        return _run_eagerly(self._fit, checked, log_prior, log_time, target, training,
                            validation_folds)

    def _fit(self, sequences: List[np.ndarray], log_prior: np.ndarray, log_time: np.ndarray,
             target: np.ndarray, training: _Training, folds: int) -> Dict[str, Any]:
        started = time.perf_counter()
        self.trained = True
        rng = np.random.default_rng([self.config.seed, self._fits])
        self._fits += 1
        accuracy = (self._validate_correction(sequences, log_prior, log_time, target, training,
                                              folds, rng) if folds else {})
        losses = self._train(sequences, log_prior, log_time, target, training, rng)
        # The best scale on the held-out folds; a tie keeps less of the correction.
        self.correction_scale = max(accuracy, key=lambda scale: (accuracy[scale], -scale),
                                    default=1.0)
        self._calibrate(sequences, log_prior, log_time, self.correction_scale)
        fitted = self._log_scores(sequences, log_prior)
        times = np.exp(log_time)
        return {"epochs": training.epochs, "seconds": time.perf_counter() - started,
                "loss": losses, "pairwise_accuracy": pairwise_accuracy(fitted, times),
                "kendall_tau": kendall_tau(fitted, times),
                "correction_scale": self.correction_scale, "validation_accuracy": accuracy}

    def _calibrate(self, sequences: List[np.ndarray], log_prior: np.ndarray,
                   log_time: np.ndarray, correction_scale: float) -> None:
        """Shifts every score by one constant (the ranking stays) to match mean log-time."""
        shift = np.mean(log_time - self._log_scores(sequences, log_prior, correction_scale))
        self._net.offset.assign_add(float(shift))

    def _train(self, sequences: List[np.ndarray], log_prior: np.ndarray, log_time: np.ndarray,
               target: np.ndarray, training: _Training, rng: np.random.Generator
               ) -> List[float]:
        """Trains from the current weights on these trials; returns the mean loss per epoch."""
        self._calibrate(sequences, log_prior, log_time, 1.0)  # training runs the whole correction
        self._optimizer.learning_rate.assign(training.learning_rate)
        x, mask = self._pad(sequences)
        norm = self.normalization
        n = len(sequences)
        pairs = np.triu(np.ones((n, n), np.float32), 1)
        consts = [np.int32(norm.stride), np.float32(norm.sum_scale)]

        def steps(idx: np.ndarray, repeats: int) -> np.ndarray:
            sub = np.ix_(idx, idx)
            return self._train_fn(np.int32(repeats), x[idx], mask[idx],
                                  log_prior[idx].astype(np.float32), *consts,
                                  log_time[idx].astype(np.float32), pairs[sub],
                                  target[sub].astype(np.float32), *training.hyper).numpy()

        if n <= training.batch_size:
            # One batch, the same every epoch: all epochs in one call, as a
            # call's overhead outweighs a step on a few dozen trials.
            return [float(loss) for loss in steps(np.arange(n), training.epochs)]
        losses = []
        for _ in range(training.epochs):
            order = rng.permutation(n)
            losses.append(float(np.mean([steps(order[start:start + training.batch_size], 1)[0]
                                         for start in range(0, n, training.batch_size)])))
        return losses

    def _validate_correction(self, sequences: List[np.ndarray], log_prior: np.ndarray,
                             log_time: np.ndarray, target: np.ndarray, training: _Training,
                             folds: int, rng: np.random.Generator) -> Dict[float, float]:
        """Correction scale -> weighted pairwise accuracy of fold models on their held-out trials.

        Each fold model trains from the initial weights on the other folds; the
        weights and optimizer state are restored afterwards.
        """
        current = self._snapshot()
        n = len(sequences)
        fold = rng.permutation(n) % folds
        base, correction = np.zeros(n), np.zeros(n)
        for k in range(folds):
            train, held = np.flatnonzero(fold != k), np.flatnonzero(fold == k)
            self._restore(self._initial_state)
            self._train([sequences[i] for i in train], log_prior[train], log_time[train],
                        target[np.ix_(train, train)], training, rng)
            held_out = [sequences[i] for i in held]
            base[held] = self._log_scores(held_out, log_prior[held], 0.0)
            correction[held] = self._log_scores(held_out, log_prior[held], 1.0) - base[held]
        self._restore(current)
        # Pairs within a fold, weighted by how sure their order is (near-ties are noise).
        weight = np.triu(fold[:, None] == fold[None, :], 1) * np.abs(2.0 * target - 1.0)
        if not weight.sum():
            return {}
        measured_order = np.sign(log_time[None, :] - log_time[:, None])
        accuracy = {}
        for scale in CORRECTION_SCALES:
            score = base + scale * correction
            agree = np.sign(score[None, :] - score[:, None]) * measured_order
            accuracy[scale] = float(np.sum(weight * ((agree > 0) + 0.5 * (agree == 0)))
                                    / weight.sum())
        return accuracy

    # ------------------------------------------------------------ persistence

    def save(self, path: str) -> None:
        """Writes weights, normalization and config to one ``.npz`` file (atomically).

        Args:
            path: the file to write; its directory must exist.
        """
        norm = self.normalization
        state = {"trained": self.trained, "fits": self._fits,
                 "correction_scale": self.correction_scale,
                 "config": dataclasses.asdict(self.config),
                 "normalization": None if norm is None else norm.to_json()}
        arrays = _run_eagerly(lambda: {f"weight_{i:03d}": np.asarray(w.numpy())
                                       for i, w in enumerate(self._net.weights)})
        if norm is not None:
            arrays.update({f"norm_{k}": v for k, v in norm.arrays().items()})
        write_state(path, state, arrays)

    @classmethod
    def load(cls, path: str, prior: Optional[Prior] = None) -> "RankingSimulator":
        """Reads a simulator written by :meth:`save`.

        Args:
            path: the file.
            prior: the prior callable (callables are not saved); None to pass
                ``prior_values`` on every call instead.

        Returns:
            RankingSimulator: scoring exactly as the saved one did.

        Raises:
            FileNotFoundError: ``path`` does not exist.
            SimulatorStateError: ``path`` is not a readable simulator state or
                does not match the architecture it declares; the message names it.
        """
        state, arrays = read_state(path)
        try:
            config = dict(state["config"])
            if config["log_columns"] is not None:
                config["log_columns"] = tuple(config["log_columns"])
            config = RankingConfig(**config)
            sim = cls(config.num_features, prior, config.units, config.seed,
                      max_steps=config.max_steps, log_columns=config.log_columns,
                      use_prior=config.use_prior)
            if state["normalization"] is not None:
                sim.normalization = Normalization.from_json(
                    state["normalization"],
                    {k[len("norm_"):]: v for k, v in arrays.items() if k.startswith("norm_")},
                    config.num_features)
            weights = [arrays[f"weight_{i:03d}"] for i in range(len(sim._net.weights))]
            if sum(k.startswith("weight_") for k in arrays) != len(weights):
                raise ValueError("it holds a different number of weights than the network has")
            _run_eagerly(sim._assign, weights)
            sim.trained, sim._fits = bool(state["trained"]), int(state["fits"])
            sim.correction_scale = float(state.get("correction_scale", 1.0))
        except Exception as err:
            raise SimulatorStateError(
                f"The RankingSimulator state in {path!r} does not fit its declared "
                f"architecture: {type(err).__name__}: {err}") from err
        return sim

    def _assign(self, weights: List[np.ndarray]) -> None:
        for variable, value in zip(self._net.weights, weights):
            if tuple(variable.shape) != value.shape:
                raise ValueError(f"weight {variable.path} has shape {tuple(variable.shape)}, "
                                 f"the file {value.shape}")
        for variable, value in zip(self._net.weights, weights):
            variable.assign(value)
