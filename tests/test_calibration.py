"""Refitting the cost model's component weights to measured trials."""
import json
import math

import numpy as np
import pytest

from autodist.simulator import COMPONENTS, CostModel
from autodist.simulator.calibration import MIN_TRIALS, Calibration, component_seconds
from autodist.simulator.features import FEATURE_NAMES, cost_model_seconds, strategy_features
from autodist.simulator.fidelity import kendall_tau
from autodist.search.sampler import SamplerConstraints, StrategySampler
from test_search import heterogeneous_cluster, synthetic_graph

pytestmark = pytest.mark.timeout(120)

GRAPH, SPEC = synthetic_graph(30), heterogeneous_cluster()
MODEL = CostModel()


def sampled(count, seed):
    """(feature sequences, component totals in seconds) of ``count`` sampled strategies."""
    sampler = StrategySampler(GRAPH.trainable_variables, SPEC, SamplerConstraints())
    strategies = sampler.sample_many(count, seed=seed)
    features = [strategy_features(s, GRAPH, SPEC, batch_size=32) for s in strategies]
    totals = [MODEL.breakdown(s, GRAPH, SPEC, batch_size=32).totals for s in strategies]
    return features, np.array([[t[name] for name in COMPONENTS] for t in totals])


def cluster_times(totals, multipliers, noise, seed):
    """A 'cluster' whose components weigh ``multipliers`` times the defaults, plus 50 ms of compute."""
    factors = np.array([multipliers.get(name, 1.0) for name in COMPONENTS])
    exact = 0.05 + totals @ factors
    return exact, exact * (1 + noise * np.random.RandomState(seed).randn(len(exact)))


def test_component_seconds_add_up_to_the_cost_models_prediction():
    features, totals = sampled(20, seed=3)
    for sequence, expected in zip(features, totals):
        assert component_seconds(sequence) == pytest.approx(expected, rel=1e-5, abs=1e-9)
        assert component_seconds(sequence).sum() == pytest.approx(cost_model_seconds(sequence),
                                                                   rel=1e-5)


def test_a_fit_recovers_the_weights_the_cluster_gives_its_components():
    # Here a serving node costs nothing, a PS part ten times its default, the ring half again.
    truth = {"ps_serving_nodes": 0.0, "ps_part_overhead": 10.0, "ring_all_reduce": 1.5}
    # 60 trials: with 30, one sample set in three led the cross-validation to a strong
    # pull under which the PS part's weight fell to 0; this test is about recovery.
    features, totals = sampled(60, seed=1)
    _, measured = cluster_times(totals, truth, noise=0.02, seed=0)
    calibration = Calibration.fit(features, measured)
    assert calibration.reweighted and math.isfinite(calibration.strength)
    assert calibration.trials == 60
    got = calibration.multipliers
    assert got["ps_serving_nodes"] < 0.5 and got["ring_all_reduce"] > 1.25
    assert got["ps_part_overhead"] > 3
    assert all(m >= 0 for m in got.values()) and calibration.intercept >= 0
    # Strategies it never saw are ranked closer to the truth than by the cost model.
    held_features, held_totals = sampled(60, seed=2)
    exact, _ = cluster_times(held_totals, truth, noise=0.0, seed=0)
    tau_cost = kendall_tau([cost_model_seconds(f) for f in held_features], exact)
    tau_calibrated = kendall_tau([calibration.seconds(f) for f in held_features], exact)
    assert tau_calibrated > tau_cost + 0.1, (tau_cost, tau_calibrated)


def test_trials_that_agree_with_the_defaults_keep_the_cost_models_ranking():
    # 40 trials: two kinds of collectives (all-reduced and sharded parts) share the
    # collective components, and 30 noisy trials left the fit a few pairs astray.
    features, totals = sampled(40, seed=1)
    _, measured = cluster_times(totals, {}, noise=0.02, seed=0)
    calibration = Calibration.fit(features, measured)
    held_features, held_totals = sampled(60, seed=2)
    exact, _ = cluster_times(held_totals, {}, noise=0.0, seed=0)
    tau_cost = kendall_tau([cost_model_seconds(f) for f in held_features], exact)
    tau_calibrated = kendall_tau([calibration.seconds(f) for f in held_features], exact)
    assert tau_calibrated >= tau_cost - 0.03, (tau_cost, tau_calibrated)
    # The constant is the compute time the cost model leaves out.
    assert calibration.intercept == pytest.approx(0.05, rel=0.5)


def test_too_few_trials_fit_nothing():
    features, totals = sampled(MIN_TRIALS - 1, seed=1)
    calibration = Calibration.fit(features, 0.05 + totals.sum(axis=1))
    assert not calibration.reweighted and calibration.intercept == 0
    assert [calibration.seconds(f) for f in features] == [cost_model_seconds(f) for f in features]


def test_a_calibration_survives_json():
    features, totals = sampled(12, seed=4)
    _, measured = cluster_times(totals, {"ps_transfer": 2.0}, noise=0.01, seed=1)
    calibration = Calibration.fit(features, measured)
    again = Calibration.from_json(json.loads(json.dumps(calibration.to_json())))
    assert again == calibration
    assert [again.seconds(f) for f in features] == [calibration.seconds(f) for f in features]
    # A component added to the cost model later keeps its default weight.
    older = calibration.to_json()
    del older["multipliers"]["optimizer_update"]
    assert Calibration.from_json(older).multipliers["optimizer_update"] == 1.0


@pytest.mark.parametrize("times, message", [
    ([0.1] * 3, "one measured time per sequence"),
    ([0.1] * 9 + [0.0], "finite number of seconds > 0"),
    ([0.1] * 9 + [math.nan], "finite number of seconds > 0"),
])
def test_bad_times_are_refused(times, message):
    features, _ = sampled(10, seed=1)
    with pytest.raises(ValueError, match=message):
        Calibration.fit(features, times)


def components_only(ms: dict) -> np.ndarray:
    """A one-row feature sequence with only these component milliseconds (and their total)."""
    row = np.zeros((1, len(FEATURE_NAMES)), np.float32)
    for name, value in ms.items():
        row[0, FEATURE_NAMES.index(f"{name}_ms")] = value
    row[0, FEATURE_NAMES.index("log_total_ms")] = math.log1p(sum(ms.values()))
    return row


def test_a_component_the_trials_barely_see_keeps_its_weight():
    """Two of 12 trials carry 0.1 ms of scatter-gather (0.1% of their step) and, by
    chance, 20 ms the components do not explain: refitting its weight would take it to
    some 200 times its default, and a strategy moving 50 ms of scatter-gather would be
    predicted at 10 s."""
    rng = np.random.RandomState(0)
    features, times = [], []
    for trial in range(12):
        ms = {"ring_all_reduce": rng.uniform(40, 90), "optimizer_update": rng.uniform(5, 30)}
        extra = 0.0
        if trial < 2:
            ms["scatter_gather"], extra = 0.1, 0.02
        features.append(components_only(ms))
        times.append(0.05 + sum(ms.values()) / 1e3 + extra)
    calibration = Calibration.fit(features, times)
    assert calibration.multipliers["scatter_gather"] == 1.0
    seen = {name for name, m in calibration.multipliers.items() if m != 1.0}
    assert seen <= {"ring_all_reduce", "optimizer_update"}
    gathered = components_only({"ring_all_reduce": 20, "scatter_gather": 50,
                                "optimizer_update": 10})
    assert calibration.seconds(gathered) < 0.3
