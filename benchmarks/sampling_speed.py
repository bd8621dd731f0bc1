"""Time to sample and score AutoStrategy's candidates for a large graph.

A search round samples 2000 candidate strategies and scores each with the
learned simulator (features, then the network). From its second round on, the
simulator is trained, so it is trained here first (on 12 strategies timed by the
cost model, give or take 20%): scores then take the calibrated prior and a pass
of the network. Goal: at most 30 s for a 400-variable graph on 4 nodes. Median
of ``--repeats`` runs.

Usage:
    python benchmarks/sampling_speed.py             # measures, writes docs/benchmarks.md
    python benchmarks/sampling_speed.py --no-write
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import report

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

BEGIN, END = "<!-- sampling_speed:begin -->", "<!-- sampling_speed:end -->"
GOAL_S = 30.0


def measure(count: int, num_vars: int) -> dict:
    """Seconds to sample ``count`` candidates of a ``num_vars``-variable graph, and to score them."""
    import numpy as np

    from autodist.graph_item import VariableInfo
    from autodist.resource_spec import ResourceSpec
    from autodist.simulator.calibration import Calibration
    from autodist.simulator.features import cost_model_seconds
    from autodist.search.search import StrategySearch

    rng = random.Random(0)
    variables = [VariableInfo(f"layer{i // 16}/v{i}", (rng.choice([128, 1024, 4096]),
                                                       rng.choice([128, 1024])), "float32",
                              sparse_grad=i == 0) for i in range(num_vars)]
    spec = ResourceSpec.from_dict({"nodes": [
        {"address": f"10.123.0.{i + 1}", "cpus": [0], "chief": i == 0} for i in range(4)]})
    search = StrategySearch(variables, spec, candidates=12)
    trained_on = [search.features(c) for c in search.candidates(1)]
    noise = np.random.default_rng(0).uniform(0.8, 1.2, len(trained_on))
    times = [cost_model_seconds(f) * k for f, k in zip(trained_on, noise)]
    search.calibration = Calibration.fit(trained_on, times)
    search.simulator.fit(trained_on, times)
    search = StrategySearch(variables, spec, candidates=count, simulator=search.simulator,
                            calibration=search.calibration)
    start = time.monotonic()
    candidates = search.candidates(0)
    sampled = time.monotonic() - start
    search.simulator.score([search.features(c) for c in candidates])
    return {"candidates": len(candidates), "sample_s": sampled,
            "total_s": time.monotonic() - start}


def _section(runs: list, args, info: dict = None,
             command: str = "python benchmarks/sampling_speed.py") -> str:
    info = info or report.machine_info()
    total = statistics.median(r["total_s"] for r in runs)
    sample = statistics.median(r["sample_s"] for r in runs)
    verdict = "holds" if total <= GOAL_S else "does not hold"
    return "\n".join([
        BEGIN, "## Sampling and scoring AutoStrategy's candidates (`sampling_speed`)", "",
        f"**Measures:** the seconds to ask for {args.candidates} candidate strategies of a "
        f"{args.variables}-variable graph on 4 nodes, as a search round does, and to score them "
        "with the learned simulator.", "",
        f"**Goal:** at most {GOAL_S:.0f} s. **Result:** the goal **{verdict}**: "
        f"{runs[0]['candidates']} candidates in **{total:.1f} s** ({sample:.1f} s sampling; "
        f"median of {len(runs)} runs: " + ", ".join(f"{r['total_s']:.1f}" for r in runs)
        + " s).", "",
        f"Measured {info['date']} on {info['cores']} cores ({info['cpu']}), TensorFlow "
        f"{info['tf']}, Python {info['python']}; 1-minute load {info['load']} at the end.", "",
        f"Command: `{command}`", "",
        "- The simulator is trained first, on 12 strategies timed by the cost model give or "
        "take 20%, as from a search's second round on: each score is the calibrated prior "
        "plus a pass of the network.",
        END])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", type=int, default=2000)
    parser.add_argument("--variables", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(REPO, "docs", "benchmarks.md"))
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    runs = []
    for _ in range(args.repeats):
        runs.append(measure(args.candidates, args.variables))
        print(f"sampling+scoring: {runs[-1]}", flush=True)
    section = _section(runs, args,
                       command=report.command_line("benchmarks/sampling_speed.py", parser, args))
    if not args.no_write:
        report.write_section(args.out, section, BEGIN, END)
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
