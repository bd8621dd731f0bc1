"""A corpus of user-style Keras scripts (``tests/keras_corpus.py``) through AutoDist.

Every script runs twice from the same seed: once on a single device and once
with its model built and compiled inside ``ad.scope()`` (its custom step
compiled by ``ad.function``) under a builder. The two runs must leave the same
weights, the same optimizer variables (names and values), the same History,
the same per-step losses and the same extras (checkpoints, CSV logs, learning
rates read back, evaluate/predict results), to 1e-5 (float16 scripts: TOLERANCE).

Cases marked xfail are product bugs (known ones, and new ones this corpus found);
each reason names its bug so the
mark can go when the bug is fixed (the marks are strict: a fix makes them fail).
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

import keras_corpus as kc
from autodist import AutoDist
from autodist.strategy import AllReduce, Parallax, PartitionedPS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180),
              # fit on a tf.data.Dataset with the default shuffle=True, as users write it
              pytest.mark.filterwarnings("ignore:`shuffle=True` was passed")]

EXACT = 1e-5  # absolute and relative

BUILDERS = {"AllReduce": AllReduce, "PartitionedPS": PartitionedPS, "Parallax": Parallax}
ALL = tuple(BUILDERS)
DENSE = ("AllReduce", "PartitionedPS")  # Parallax is AllReduce for a model without embeddings

# Parallax differs from AllReduce where a model has sparse (Embedding) gradients or
# trainable variables without a gradient; the other scripts run under AllReduce and
# PartitionedPS only, to keep the file near three minutes.
WITH_PARALLAX = {
    "cnn_with_callbacks", "multi_input_multi_output", "transformer_position_embedding",
    "transformer_dynamic_positions", "structured_lookup_layers", "structured_hashing",
    "structured_lookup_in_dataset", "gan_custom_loop", "gan_overriding_train_step",
    "transfer_learning_fine_tune", "bidirectional_lstm_masked", "siamese_shared_encoder",
}
# script -> the builders it runs under.
SCRIPT_BUILDERS = {name: ALL if name in WITH_PARALLAX else DENSE for name in kc.SCRIPTS}
# clipnorm reduces over each variable: refused for the variables PartitionedPS cuts
# (documented; test_clipnorm_on_a_cut_lstm_is_refused_by_name below).
SCRIPT_BUILDERS["lstm_stacked_sequences"] = ("AllReduce", "Parallax")

# Scripts AutoDist refuses, by name: (the error, what its message says).
REFUSED = {
    "gan_custom_loop": (NotImplementedError,
                        r"one optimizer update per step; train_step applies 2 \(Adam, Adam\)"),
    "gan_overriding_train_step": (NotImplementedError,
                                  r"one optimizer update per step; train_step applies 2"),
    "optimizer_ema": (NotImplementedError,
                      r"moving average of the weights: AdamW in train_step is created with "
                      r"use_ema=True"),
}
# Scripts computing in float16: each replica rounds its own rows' partial sums, a single
# device the whole batch's (tests/test_keras_mixed_precision.py checks the loss scale's
# course step by step).
TOLERANCE = {"mixed_precision": 5e-3}
# Scripts that train differently by design or are not distributed yet, each with why.
DIFFERS = {
    "custom_layers_add_loss": (
        "documented (README, Keras section): add_loss(rate * ops.sum(inputs)) sums over each "
        "replica's rows, and the replicas' gradients are averaged, so the penalty trains at "
        "1/2 of its single-device gradient on two replicas"),
}


def corpus_cases(script_builders: dict, differs: dict, refused=()) -> list:
    """pytest params (script, builder) of every script's builders but the ``refused``
    scripts'; a script of ``differs`` is a strict xfail naming why."""
    def marks(script: str) -> list:
        if script not in differs:
            return []
        return [pytest.mark.xfail(strict=True, raises=AssertionError, reason=differs[script])]

    return [pytest.param(script, builder, marks=marks(script), id=f"{script}-{builder}")
            for script, builders in script_builders.items() for builder in builders
            if script not in refused]


CASES = corpus_cases(SCRIPT_BUILDERS, DIFFERS, REFUSED)
REFUSED_CASES = [(script, builder) for script in REFUSED for builder in SCRIPT_BUILDERS[script]]


# ----------------------------------------------------------------------------- comparison

def _assert_close(got, want, what: str, tolerance: float = EXACT) -> None:
    """Compares nested lists, tuples and dicts of numbers and arrays at ``tolerance``."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), f"{what}: keys"
        for key in want:
            _assert_close(got[key], want[key], f"{what}[{key!r}]", tolerance)
    elif isinstance(want, (list, tuple)) and any(
            isinstance(w, (dict, list, tuple, np.ndarray)) for w in want):
        assert len(got) == len(want), f"{what}: length {len(got)} != {len(want)}"
        for index, (g, w) in enumerate(zip(got, want)):
            _assert_close(g, w, f"{what}[{index}]", tolerance)
    else:
        got, want = np.asarray(got), np.asarray(want)
        assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
        np.testing.assert_allclose(got, want, atol=tolerance, rtol=tolerance, err_msg=what)


def assert_same(got: kc.Result, want: kc.Result, what: str, tolerance: float = EXACT) -> None:
    assert len(got.weights) == len(want.weights), f"{what}: number of weights"
    for index, (g, w) in enumerate(zip(got.weights, want.weights)):
        _assert_close(g, w, f"{what}: model weight #{index}", tolerance)
    assert list(got.optimizer_variables) == list(want.optimizer_variables), \
        f"{what}: optimizer variable names"
    for name, w in want.optimizer_variables.items():
        _assert_close(got.optimizer_variables[name], w, f"{what}: optimizer variable {name}",
                      tolerance)
    _assert_close(got.history, want.history, f"{what}: History", tolerance)
    _assert_close(got.losses, want.losses, f"{what}: per-step losses", tolerance)
    _assert_close(got.extras, want.extras, f"{what}: extras", tolerance)


# ----------------------------------------------------------------------------- runs

@functools.lru_cache(maxsize=None)
def single(script: str) -> kc.Result:
    """The script on a single device (no-op scope, tf.function)."""
    return kc.SCRIPTS[script](kc.Env())


def distributed(spec: str, builder: str, script: str, workdir) -> kc.Result:
    ad = AutoDist(resource_spec_file=spec, strategy_builder=BUILDERS[builder]())
    return kc.SCRIPTS[script](kc.Env(scope=ad.scope, function=ad.function, workdir=workdir,
                                     name=builder))


@pytest.mark.parametrize("script, builder", CASES)
def test_script_matches_single_device(spec_path, tmp_path, script, builder):
    got = distributed(spec_path, builder, script, tmp_path)
    assert_same(got, single(script), f"{script} under {builder}",
                TOLERANCE.get(script, EXACT))


@pytest.mark.parametrize("script, builder", REFUSED_CASES)
def test_script_is_refused_by_name(spec_path, tmp_path, script, builder):
    error, message = REFUSED[script]
    with pytest.raises(error, match=message):
        distributed(spec_path, builder, script, tmp_path)


def test_clipnorm_on_a_cut_lstm_is_refused_by_name(spec_path, tmp_path):
    with pytest.raises(NotImplementedError,
                       match=r"cannot cut '.*lstm.*' under Adam: its update is not elementwise"):
        distributed(spec_path, "PartitionedPS", "lstm_stacked_sequences", tmp_path)


# ----------------------------------------------------------------------------- exercised

# script -> a property of its single-device run that shows the pattern took effect,
# so that matching it under AutoDist means something.
EXERCISED = {
    "cnn_with_callbacks": lambda r: (  # EarlyStopping fired; CSVLogger logged every epoch
        r.extras["epochs_run"] < 4 and len(r.extras["csv_log"]["loss"]) == r.extras["epochs_run"]),
    "lr_scheduler": lambda r: r.history["learning_rate"] == pytest.approx([0.05, 0.025, 0.0125]),
    "lr_drops_to_zero": lambda r: r.extras["epoch_1_change"] == 0.0,
    "lr_warmup_callback": lambda r: r.extras["learning_rates"][:6] == pytest.approx(
        [0.05 * k / 6 for k in range(1, 7)]),
    "reduce_lr_on_plateau": lambda r: r.extras["final_learning_rate"] < 0.02,
    "custom_train_step_loss_tracker": lambda r: r.extras["tracker"][1] == 4,  # 4 steps an epoch
    "imbalanced_class_weight": lambda r: 0 < r.extras["positives"] < 16,
    "transformer_position_embedding": lambda r: np.allclose(
        r.history["loss"], single("transformer_dynamic_positions").history["loss"]),
    "tf_data_pipeline": lambda r: r.optimizer_variables["iteration"] == 8,
    "repeated_dataset_steps_per_epoch": lambda r: r.optimizer_variables["iteration"] == 12,
    "transfer_learning_fine_tune": lambda r: len(r.history) == 4,
    "mixed_precision": lambda r: all(r.extras["compute_dtype"]) and r.extras["loss_scaled"],
    "timeseries_gru": lambda r: r.optimizer_variables["iteration"] == 8,  # 16, 16, 16, 4 rows
    "pydataset_generator": lambda r: r.optimizer_variables["iteration"] == 8,
    "optimizer_ema": lambda r: np.array_equal(  # fit ended with the averages
        r.weights[0], r.optimizer_variables["sequential_dense_kernel_average"]),
    "optimizer_nadam": lambda r: 0 < float(r.optimizer_variables["variable"]) < 1,
    "per_batch_lambda_logger": lambda r: len(r.extras["batch_logs"]) == 8 and len(
        set(r.extras["weight_norms"])) == 8,
}


@pytest.mark.parametrize("script", sorted(EXERCISED))
def test_single_device_run_exercises_the_pattern(script):
    assert EXERCISED[script](single(script))
