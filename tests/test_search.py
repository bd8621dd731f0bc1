"""The strategy search: its rounds on a known cost landscape, AutoStrategy, the CLI."""
import dataclasses
import json
import os
import random
import re
import types

import numpy as np
import pytest

from autodist.graph_item import VariableInfo
from autodist.resource_spec import ResourceSpec
from autodist.simulator import CostModel
from autodist.simulator.calibration import Calibration
from autodist.simulator.features import cost_model_seconds
from autodist.simulator.fidelity import kendall_tau
from autodist.search import AutoStrategy
from autodist.strategy import BUILDERS, Strategy
from autodist.strategy.compiler import NodeMemoryError
from autodist.search.builder import SearchSettings, search_strategy
from autodist.search.search import EXPLORE_SHARE, SearchResult, StrategySearch
from autodist.search.trial import CapturedGraph, TrialResult
from test_equivalence import assert_equivalent

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "train_mlp.py")


def heterogeneous_cluster() -> ResourceSpec:
    rates = [2.5, 2.5, 0.5, 0.5]
    return ResourceSpec.from_dict({"nodes": [
        {"address": f"10.123.0.{i + 1}", "cpus": [0], "chief": i == 0,
         "network_bandwidth": rate} for i, rate in enumerate(rates)]})


def synthetic_graph(count: int = 60) -> CapturedGraph:
    rng = random.Random(0)
    variables = [VariableInfo(f"layer{i}/w", (rng.choice([64, 256, 1024]),
                                              rng.choice([64, 256, 512])), "float32")
                 for i in range(count)]
    variables.append(VariableInfo("embedding", (50_000, 64), "float32", sparse_grad=True))
    return CapturedGraph(variables, "synthetic", "synthetic")


class Landscape:
    """A 'cluster' whose step time the cost model gets wrong in a known way.

    Here all-reduce and PS traffic overlap (as if on separate links), so a step
    takes the longer of the two, not their sum as the cost model assumes:
    strategies splitting the bytes between both beat every hand-written
    builder, and only trials can teach the simulator that. A fixed compute
    time and 2% noise come on top.
    """

    def __init__(self, graph, spec):
        self.graph, self.spec = graph, spec
        self.model = CostModel()
        self.noise = np.random.RandomState(0)

    def exact(self, strategy) -> float:
        totals = self.model.breakdown(strategy, self.graph, self.spec, batch_size=32).totals
        collectives = totals["ring_all_reduce"] + totals["all_gather"] + totals["collective_latency"]
        return 0.05 + max(collectives, totals["ps_transfer"] + totals["ps_part_overhead"])

    def __call__(self, strategy) -> TrialResult:
        return TrialResult(self.exact(strategy) * (1 + 0.02 * self.noise.randn()))


def test_the_search_scores_a_graph_trained_with_accumulation_per_run():
    spec = heterogeneous_cluster()
    dense = synthetic_graph(8)
    graph = dataclasses.replace(dense, trainable_variables=dense.trainable_variables[:-1])
    accumulated = dataclasses.replace(graph, accumulation_steps=4)
    strategy = BUILDERS["AllReduce"]().build(graph, spec)
    plain = StrategySearch(graph, spec).features(strategy)
    per_run = StrategySearch(accumulated, spec).features(strategy)
    # Dense gradients only: a run pays a quarter of the sync.
    assert cost_model_seconds(per_run) == pytest.approx(cost_model_seconds(plain) / 4)


@pytest.mark.timeout(240)
def test_a_search_on_a_known_landscape():
    graph, spec = synthetic_graph(), heterogeneous_cluster()
    landscape = Landscape(graph, spec)
    builders = {name: cls().build(graph, spec) for name, cls in BUILDERS.items()}
    search = StrategySearch(graph, spec, candidates=400, per_round=4, seed=1)
    held_out = StrategySearch(graph, spec, candidates=60, seed=99).candidates(0)
    held_features = [search.features(s) for s in held_out]
    truth = [landscape.exact(s) for s in held_out]
    tau_prior = kendall_tau(search.simulator.score(held_features), truth)

    result = search.run(landscape, trials=20, builders=builders)

    sources = [t.source for t in result.trials]
    # Half the budget at most opens with builders, the cost model's favourites first.
    opening = min(len(builders), 20 // 2)
    assert sources[:opening] == [s for s in sources if s.startswith("builder:")]
    predicted = [cost_model_seconds(search.features(builders[s.split(":")[1]]))
                 for s in sources[:opening]]
    assert predicted == sorted(predicted)
    # The first round is scored by a simulator already trained on the builders' trials.
    first_round = result.trials[opening]
    assert first_round.predicted != pytest.approx(first_round.cost_model, rel=1e-3)
    assert len(sources) == 20 and len({t.strategy.id for t in result.trials}) == 20
    # A quarter of the trials the search picked were drawn at random.
    explored = round(EXPLORE_SHARE * (20 - opening))
    assert sources.count("explore") == explored and sources.count("search") == 20 - opening - explored
    # The result is the fastest trial, and the search found better than every builder.
    measured = [t.result.seconds_per_step for t in result.trials]
    assert result.best_seconds == min(measured)
    assert result.best_seconds < result.baseline_seconds
    assert result.hit_rate > 0
    # Trials taught the simulator what the cost model did not know.
    tau_trained = kendall_tau(search.simulator.score(held_features), truth)
    assert tau_trained > tau_prior + 0.05, (tau_prior, tau_trained)


@pytest.mark.timeout(240)
def test_the_next_search_on_the_same_problem_picks_up_simulator_and_calibration(tmp_path):
    graph, spec = synthetic_graph(20), heterogeneous_cluster()
    landscape = Landscape(graph, spec)
    runner = types.SimpleNamespace(trial=lambda strategy, warmup, steps: landscape(strategy))
    settings = SearchSettings(trials=12, candidates=100, log_dir=str(tmp_path), progress=False)
    first = search_strategy(graph, spec, runner, settings)
    saved = json.loads((tmp_path / "calibration.json").read_text())
    assert Calibration.from_json(saved) == first.calibration and first.calibration.trials == 12
    # Without trials, the same graph and cluster: both come back and score as before.
    again = search_strategy(graph, spec, None, dataclasses.replace(settings, trials=0))
    assert again.calibration == first.calibration and again.simulator.trained
    candidates = StrategySearch(graph, spec, candidates=50, seed=5).candidates(0)
    features = [StrategySearch(graph, spec).features(c) for c in candidates]
    assert np.allclose(again.simulator.score(features), first.simulator.score(features))
    # A continued search refits the calibration once it has enough trials of its own.
    few = search_strategy(graph, spec, runner, dataclasses.replace(settings, trials=4,
                                                                    with_builders=False))
    assert len(few.trials) == 4 and few.calibration == first.calibration
    # Another cluster starts from the cost model.
    other = ResourceSpec.from_dict({"nodes": [
        {"address": f"10.123.0.{i + 1}", "cpus": [0], "chief": i == 0, "network_bandwidth": 1.0}
        for i in range(4)]})
    fresh = search_strategy(graph, other, None, dataclasses.replace(settings, trials=0))
    assert not fresh.simulator.trained and fresh.calibration == Calibration()


def test_auto_strategy_without_trials_trains_like_one_device(spec_path, tmp_path):
    """trials=0: the simulator's pick, no runs; training is still exact."""
    builder = AutoStrategy(trials=0, candidates=50, log_dir=str(tmp_path), progress=False)
    strategy = assert_equivalent(spec_path, builder, "partitionable", "adam")
    assert Strategy.load(str(tmp_path / "best.strategy")) == strategy
    assert not (tmp_path / "trials.jsonl").exists() and not (tmp_path / "trials").exists()


def test_auto_strategy_rejects_bad_settings():
    with pytest.raises(ValueError, match="trials must be an integer >= 0, got -1"):
        AutoStrategy(trials=-1)
    with pytest.raises(ValueError, match="steps must be an integer >= 1, got 0"):
        AutoStrategy(steps=0)
    with pytest.raises(ValueError,
                       match="min_timed_seconds must be a finite number of seconds >= 0, got -1"):
        AutoStrategy(min_timed_seconds=-1)
    # The settings check themselves, for the CLI and anything else that builds them.
    with pytest.raises(ValueError, match="per_round must be an integer >= 1, got 0"):
        SearchSettings(per_round=0)


@pytest.mark.parametrize("timeout", [0, -5.0, float("nan"), float("inf"), True, "600"])
def test_search_settings_refuse_a_trial_timeout_that_is_not_a_finite_positive_number(timeout):
    with pytest.raises(ValueError, match=re.escape(
            f"trial_timeout must be a finite number of seconds > 0, got {timeout!r}.")):
        SearchSettings(trial_timeout=timeout)
    assert SearchSettings(trial_timeout=0.5).trial_timeout == 0.5


class StepRecorder:
    """Stands in for the script runner: notes the timed steps each trial asks for."""

    def __init__(self, seconds_per_step: float):
        self.seconds_per_step, self.steps = seconds_per_step, []

    def trial(self, strategy, warmup: int, steps: int) -> TrialResult:
        self.steps.append(steps)
        return TrialResult(self.seconds_per_step)


@pytest.mark.parametrize("min_timed_seconds, seconds_per_step, want", [
    (2.0, 0.05, [4, 40, 40]),   # 4 steps of 50 ms are too short: later trials time 2 s
    (2.0, 0.8, [4, 4, 4]),      # 4 steps of 0.8 s already last 2 s
    (0.0, 0.05, [4, 4, 4]),     # off
])
def test_trials_time_enough_steps_at_the_fastest_measured_step(tmp_path, min_timed_seconds,
                                                               seconds_per_step, want):
    recorder = StepRecorder(seconds_per_step)
    settings = SearchSettings(trials=3, candidates=20, per_round=1, with_builders=False,
                              warmup=1, steps=4, log_dir=str(tmp_path), progress=False,
                              min_timed_seconds=min_timed_seconds)
    search_strategy(synthetic_graph(10), heterogeneous_cluster(), recorder, settings)
    assert recorder.steps == want


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_search_command_on_the_example(tmp_path, capsys):
    from autodist import cli
    log_dir, out = tmp_path / "log", tmp_path / "best.strategy"
    status = cli.main(["search", EXAMPLE, "--trials", "4", "--candidates", "100",
                       "--per-round", "2", "--warmup", "2", "--steps", "3",
                       "--log-dir", str(log_dir), "--out", str(out), "--", "--steps", "40"])
    assert status == 0
    lines = [json.loads(line) for line in (log_dir / "trials.jsonl").read_text().splitlines()]
    assert [line["trial"] for line in lines] == [1, 2, 3, 4]
    assert [line["source"].split(":")[0] for line in lines] == ["builder"] * 2 + ["search"] * 2
    assert all(line["measured_s"] > 0 and line["error"] == "" for line in lines)
    assert all(line["predicted_s"] > 0 for line in lines[2:])
    best = Strategy.load(str(out))
    assert best.id == min(lines, key=lambda line: line["measured_s"])["strategy_id"]
    assert (log_dir / "search.png").read_bytes()[:4] == b"\x89PNG"
    assert (log_dir / "simulator.npz").exists() and (log_dir / "calibration.json").exists()
    printed = capsys.readouterr().out
    assert "Best:" in printed and "4/4" in printed

    # `autodist explain` breaks the chosen strategy down for the same script.
    assert cli.main(["explain", str(out), "--script", EXAMPLE]) == 0
    printed = capsys.readouterr().out
    assert f"Strategy {best.id}" in printed and "dense/kernel" in printed


def test_explain_names_a_missing_script(tmp_path, capsys):
    from autodist import cli
    strategy = tmp_path / "s.strategy"
    BUILDERS["PS"]().build(synthetic_graph(2), heterogeneous_cluster()).save(str(strategy))
    assert cli.main(["explain", str(strategy), "--script", str(tmp_path / "nope.py")]) == 1
    assert "nope.py' does not exist" in capsys.readouterr().err


def _command_args(tmp_path, command: str) -> tuple:
    """(the command's arguments, a file its script creates if it runs, the search's log dir)."""
    script, ran, log_dir = tmp_path / "train.py", tmp_path / "ran", tmp_path / "log"
    script.write_text(f"open({str(ran)!r}, 'w').close()\n")
    strategy = tmp_path / "s.strategy"
    BUILDERS["PS"]().build(synthetic_graph(2), heterogeneous_cluster()).save(str(strategy))
    where = {"search": [str(script), "--log-dir", str(log_dir)],
             "explain": [str(strategy), "--script", str(script)]}[command]
    return where, ran, log_dir


@pytest.mark.parametrize("command", ["search", "explain"])
def test_a_command_names_a_bad_spec_before_running_the_script(tmp_path, capsys, command):
    from autodist import cli
    where, ran, log_dir = _command_args(tmp_path, command)
    spec = tmp_path / "cluster.yml"
    spec.write_text("nodes: []\n")
    assert cli.main([command, *where, "--spec", str(spec)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"autodist {command}: error: ") and str(spec) in err
    assert "Traceback" not in err
    assert not ran.exists() and not log_dir.exists()


@pytest.mark.parametrize("command, option, value, message", [
    ("search", "--min-timed-seconds", "-1", "min_timed_seconds must be a finite number of seconds "
                                            ">= 0, got -1.0."),
    ("search", "--steps", "0", "steps must be an integer >= 1, got 0."),
    ("search", "--trial-timeout", "0", "trial_timeout must be a finite number of seconds > 0, "
                                       "got 0.0."),
    ("explain", "--batch-size", "0", "batch_size must be an integer >= 1, got 0."),
    ("explain", "--trial-timeout", "-1", "trial_timeout must be a finite number of seconds > 0, "
                                         "got -1.0."),
    ("explain", "--top", "-1", "top must be an integer >= 0, got -1."),
    # The strategy's path is checked before the search, not after it.
    ("search", "--out", "/nonexistent/best.strategy",
     "--out /nonexistent/best.strategy: its directory /nonexistent does not exist."),
    ("search", "--out", "/", "--out / is a directory; give the path of a file."),
])
def test_a_command_refuses_a_bad_option_before_running_the_script(tmp_path, capsys, command,
                                                                  option, value, message):
    from autodist import cli
    where, ran, log_dir = _command_args(tmp_path, command)
    with pytest.raises(SystemExit) as exited:
        cli.main([command, *where, option, value])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == f"autodist {command}: error: {message}"
    assert "Traceback" not in err
    assert not ran.exists() and not log_dir.exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("share, random_picks", [(0.0, 0), (0.3, 2), (1.0, 8)])
def test_a_share_of_the_search_trials_is_drawn_at_random(share, random_picks):
    graph, spec = synthetic_graph(10), heterogeneous_cluster()
    search = StrategySearch(graph, spec, candidates=40, per_round=3, explore_share=share)
    result = search.run(lambda s: TrialResult(cost_model_seconds(search.features(s))), trials=8)
    sources = [t.source for t in result.trials]
    # Each round's random picks come first; over the search they keep to their share.
    assert sources.count("explore") == random_picks and len(sources) == 8
    assert all(sources[i:i + 3] == sorted(sources[i:i + 3]) for i in range(0, 8, 3))


def test_the_explore_share_is_checked():
    with pytest.raises(ValueError, match="explore_share must be within \\[0, 1\\], got 1.5"):
        StrategySearch(synthetic_graph(2), heterogeneous_cluster(), explore_share=1.5)


def test_a_search_stops_when_every_strategy_was_tried():
    """A single tiny variable on 4 nodes has only a handful of strategies."""
    graph = CapturedGraph([VariableInfo("w", (4,), "float32")], "tiny", "tiny")
    search = StrategySearch(graph, heterogeneous_cluster(), candidates=200, per_round=4)
    result = search.run(lambda s: TrialResult(0.1 + int(s.id[-4:], 16) * 1e-6), trials=60)
    ids = [t.strategy.id for t in result.trials]
    assert 2 < len(ids) < 60 and len(set(ids)) == len(ids)


@pytest.mark.timeout(120)
def test_ctrl_c_ends_the_search_with_the_best_strategy_so_far(tmp_path):
    graph, spec = synthetic_graph(6), heterogeneous_cluster()
    search = StrategySearch(graph, spec, candidates=40, per_round=2)
    times = iter([0.3, 0.2, 0.25])

    def measure(strategy):
        try:
            return TrialResult(next(times))
        except StopIteration:
            raise KeyboardInterrupt from None

    result = search.run(measure, trials=10)
    assert result.interrupted and len(result.trials) == 3
    assert result.best_seconds == 0.2 and result.best is result.trials[1].strategy


class LandscapeRunner:
    """Stands in for the script runner with a :class:`Landscape`'s step times."""

    def __init__(self, graph, spec):
        self.landscape = Landscape(graph, spec)

    def trial(self, strategy, warmup: int, steps: int) -> TrialResult:
        return self.landscape(strategy)


def _searched_with(tmp_path, **arguments) -> SearchResult:
    graph, spec = synthetic_graph(6), heterogeneous_cluster()
    settings = SearchSettings(trials=6, candidates=40, per_round=2, with_builders=False,
                              log_dir=str(tmp_path / "log"), progress=False)
    return search_strategy(graph, spec, LandscapeRunner(graph, spec), settings, **arguments)


def test_a_second_ctrl_c_while_the_plot_is_drawn_leaves_the_best_strategy_saved(
        tmp_path, monkeypatch):
    from autodist.search import builder

    def interrupted_plot(path, result):
        raise KeyboardInterrupt

    monkeypatch.setattr(builder, "plot", interrupted_plot)
    out = tmp_path / "out.strategy"
    result = _searched_with(tmp_path, out=str(out))
    assert result.interrupted and result.plot_skipped and result.plot_path is None
    for path in (out, tmp_path / "log" / "best.strategy"):
        assert Strategy.load(str(path)).id == result.best.id
    assert (tmp_path / "log" / "calibration.json").exists()


def test_a_ctrl_c_while_the_results_are_saved_waits_until_they_are(tmp_path, monkeypatch):
    import signal
    from autodist.simulator.ranking import RankingSimulator
    save = RankingSimulator.save

    def save_then_ctrl_c(self, path):
        os.kill(os.getpid(), signal.SIGINT)  # as a terminal would, in the middle of the saves
        return save(self, path)

    monkeypatch.setattr(RankingSimulator, "save", save_then_ctrl_c)
    result = _searched_with(tmp_path)
    assert result.interrupted and result.plot_skipped
    log = tmp_path / "log"
    assert Strategy.load(str(log / "best.strategy")).id == result.best.id
    assert (log / "simulator.npz").exists() and (log / "calibration.json").exists()
    assert not (log / "search.png").exists()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_search_command_says_plainly_when_a_ctrl_c_left_nothing_to_save(
        tmp_path, monkeypatch, capsys, spec_path):
    from autodist import cli
    from autodist.search import commands

    class InterruptedRunner:
        def capture(self):
            return CapturedGraph(synthetic_graph(4).trainable_variables, "f", spec_path)

        def trial(self, strategy, warmup, steps):
            raise KeyboardInterrupt  # the first trial is cut short

    monkeypatch.setattr(commands, "_runner", lambda args, workdir: InterruptedRunner())
    out = tmp_path / "best.strategy"
    status = cli.main(["search", EXAMPLE, "--trials", "2", "--no-builders", "--candidates", "20",
                       "--log-dir", str(tmp_path / "log"), "--out", str(out)])
    assert status == 130 and not out.exists()
    assert (f"Interrupted (Ctrl-C) before any trial finished: nothing is saved, {out} was not "
            "written.") in capsys.readouterr().err


def test_ctrl_c_before_any_trial_succeeded_is_not_swallowed():
    search = StrategySearch(synthetic_graph(4), heterogeneous_cluster(), candidates=20)

    def measure(strategy):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        search.run(measure, trials=4)


def test_a_search_measures_and_picks_only_strategies_the_nodes_can_hold():
    """With a node's ``memory`` in the spec, a 1 GiB table (with Adam's moments) that a
    copy per node would not fit is only ever partitioned over parameter servers."""
    table = VariableInfo("table", (2 ** 22, 64), "float32", sparse_grad=True,
                         slot_bytes=2 ** 31)
    graph = CapturedGraph([table, VariableInfo("dense", (64, 64), "float32")], "big", "big")
    spec = ResourceSpec.from_dict({"nodes": [
        {"address": f"10.0.0.{i}", "cpus": [0], "chief": i == 1, "memory": "1g"}
        for i in range(1, 5)]})
    search = StrategySearch(graph, spec, candidates=200, per_round=2, seed=3)
    builders = {name: cls().build(graph, spec) for name, cls in BUILDERS.items()}
    fitting = {name for name, strategy in builders.items() if search.fits(strategy)}
    assert fitting == {"PartitionedPS", "UnevenPartitionedPS"}
    candidates = search.candidates(0)
    assert 0 < len(candidates) < 200

    def parts_per_server(strategy):
        table_config = strategy.node_config_by_name()["table"]
        servers = [p.PSSynchronizer.reduction_destination for p in table_config.part_config]
        return max(servers.count(s) for s in servers), len(servers)

    for strategy in candidates + [search.best_predicted()]:
        most, parts = parts_per_server(strategy)
        assert parts >= 4 and most <= parts // 4 + 1
    result = search.run(lambda s: TrialResult(0.1), trials=6, builders=builders)
    sources = [t.source for t in result.trials]
    assert sorted(sources[:2]) == ["builder:PartitionedPS", "builder:UnevenPartitionedPS"]
    assert len(sources) == 6 and all(search.fits(t.strategy) for t in result.trials)


def test_a_search_says_when_no_strategy_fits_the_nodes_memory():
    table = VariableInfo("table", (2 ** 22, 64), "float32", sparse_grad=True)
    graph = CapturedGraph([table], "big", "big")
    spec = ResourceSpec.from_dict({"nodes": [
        {"address": f"10.0.0.{i}", "cpus": [0], "chief": i == 1, "memory": "64m"}
        for i in range(1, 3)]})
    nothing_fits = r"None of the 50 strategies sampled, nor a builder's, fits the nodes' memory"
    with pytest.raises(NodeMemoryError, match=nothing_fits):
        StrategySearch(graph, spec, candidates=50).best_predicted()
    builders = {name: cls().build(graph, spec) for name, cls in BUILDERS.items()}
    with pytest.raises(NodeMemoryError, match=nothing_fits):
        StrategySearch(graph, spec, candidates=50).run(lambda s: TrialResult(0.1), trials=4,
                                                       builders=builders)
