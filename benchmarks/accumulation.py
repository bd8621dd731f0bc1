"""Gradient accumulation: time per example with one sync per run against one per 4 runs.

The model is ``step_time.py``'s: float32 variables of 51 MB in all behind a
negligible forward pass (SGD), so that synchronization is most of a step. The
cluster: 4 emulated nodes (``autodist emulate``), one CPU replica each, links
shaped to ``--bandwidth`` both ways.

Method: the cluster is built once; rounds are interleaved (each round runs
every builder with every accumulation setting once), each run a fresh job
whose chief times ``--steps`` runs after ``--warmup`` runs, both multiples of
every setting, so the timed runs are whole cycles. A job's figure is its mean
time per run (a cycle's runs differ: all but the last only keep gradients);
divided by the rows one run trains on, it is the time per example. A
setting's figure is the median over rounds; the speed-up is accumulation 1's
time per example over the setting's.

Usage (root, iproute2):
    python benchmarks/accumulation.py                      # writes docs/benchmarks.md
    python benchmarks/accumulation.py --rounds 1 --no-write

The table is printed and, unless ``--no-write``, written into ``--out`` between
``<!-- accumulation:begin -->`` and ``<!-- accumulation:end -->``.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

import report
import step_time

report.use_job_environment()  # before TensorFlow loads

BEGIN = "<!-- accumulation:begin -->"
END = "<!-- accumulation:end -->"
CLUSTER_NAME = "adaccum"
# A PS strategy reads the variables from their servers at every run unless a
# local proxy keeps a copy, refreshed once per update: both are measured.
DEFAULT_BUILDERS = ("AllReduce", "PartitionedPS", "PartitionedPS:local_proxy_variable=True")


def measure(args) -> dict:
    """(builder, accumulation steps) -> seconds per run of every round."""
    cases = [(builder, steps) for builder in args.builders for steps in args.accumulation]
    runs = {case: [] for case in cases}
    with step_time.emulated_spec(args.nodes, args.bandwidth, args.name) as (cluster, spec):
        for round_index in range(args.rounds):
            for builder, steps in cases:
                args.accumulation_steps = steps
                row = step_time.run_case(cluster, spec, builder, args)
                label = f"round {round_index + 1} {builder} accumulation {steps}"
                if "times" not in row:
                    print(f"{label}: {row['error']}", flush=True)
                    continue
                per_run = row["wall_s"] / args.steps
                print(f"{label}: {per_run:.3f} s per run", flush=True)
                runs[(builder, steps)].append(per_run)
    return runs


def summarize(runs: dict, examples_per_run: int) -> list:
    """One row per case: median seconds per run and per example, speed-up over no accumulation."""
    table = []
    for (builder, steps), seconds in runs.items():
        median = statistics.median(seconds) if seconds else None
        table.append({"builder": builder, "steps": steps, "per_run": median,
                      "per_example": median / examples_per_run if median else None,
                      "rounds": len(seconds)})
    for line in table:
        base = next(b for b in table if b["builder"] == line["builder"] and b["steps"] == 1)
        if line["per_example"] and base["per_example"]:
            line["speedup"] = base["per_example"] / line["per_example"]
    return table


def _ms(value) -> str:
    return "failed" if value is None else f"{value * 1e3:.2f}"


def format_markdown(table: list, args, nbytes: int, examples: int, command: str) -> str:
    info = report.machine_info()
    lines = [
        BEGIN,
        "## Gradient accumulation on 4 nodes (`accumulation`)", "",
        f"**Measures:** time per example with `accumulation_steps` 1 (a sync every run) "
        f"against more runs per sync, on {args.nodes} emulated nodes at {args.bandwidth} "
        f"(one CPU replica each), the model of `step_time` ({nbytes / 1e6:.1f} MB of float32, "
        f"SGD), {examples} examples per run.", "",
        f"Measured {info['date']} on {info['cores']} cores ({info['cpu']}) shared by the "
        f"{args.nodes} nodes, TensorFlow {info['tf']}; median over {args.rounds} interleaved "
        f"rounds of fresh jobs, each the mean of {args.steps} runs (whole cycles) after "
        f"{args.warmup} warm-up runs; 1-minute load {info['load']} at the end.", "",
        f"Command: `{command}`", "",
        "| builder | accumulation_steps | s per run | ms per example | speed-up |",
        "|---|--:|--:|--:|--:|"]
    for line in table:
        speedup = f"{line['speedup']:.2f}x" if "speedup" in line else "n/a"
        per_run = "failed" if line["per_run"] is None else f"{line['per_run']:.3f}"
        lines.append(f"| `{line['builder']}` | {line['steps']} | {per_run} | "
                     f"{_ms(line['per_example'])} | {speedup} |")
    lines += ["", "Findings:", ""]
    for line in table:
        if line["steps"] > 1 and "speedup" in line:
            lines.append(f"- `{line['builder']}` with {line['steps']} runs per sync: "
                         f"{line['speedup']:.2f}x the examples per second of a sync every run.")
    lines += ["- A run that only keeps its gradients costs its forward and backward pass; "
              "the sync and the update are paid once per cycle. A PS strategy without a "
              "local proxy still reads every variable from its server at every run.", END]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--nodes", type=int, default=4, help="emulated nodes (default: 4)")
    parser.add_argument("--bandwidth", default="1gbit",
                        help="link rate each way, tc syntax (default: 1gbit)")
    parser.add_argument("--builders", nargs="+", default=list(DEFAULT_BUILDERS),
                        help="builders, step_time syntax (default: "
                             f"{' '.join(DEFAULT_BUILDERS)})")
    parser.add_argument("--accumulation", nargs="+", type=int, default=[1, 4],
                        help="accumulation_steps settings; 1 is always measured (default: 1 4)")
    parser.add_argument("--mb", type=float, default=50.0,
                        help="approximate model size in MB of float32 (default: 50)")
    parser.add_argument("--vars", type=int, default=4, help="number of square variables (default: 4)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: 3)")
    parser.add_argument("--steps", type=int, default=12,
                        help="timed runs per job, a multiple of every setting (default: 12)")
    parser.add_argument("--warmup", type=int, default=4,
                        help="untimed runs first, a multiple of every setting (default: 4)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per job (default: 300)")
    parser.add_argument("--name", default=CLUSTER_NAME,
                        help=f"emulated cluster name (default: {CLUSTER_NAME})")
    parser.add_argument("--out", default=os.path.join(report.REPO, "docs", "benchmarks.md"),
                        help="markdown file whose accumulation section is rewritten")
    parser.add_argument("--no-write", action="store_true", help="only print the table")
    args = parser.parse_args(argv)
    args.accumulation = sorted(set(args.accumulation) | {1})
    cycle = math.lcm(*args.accumulation)
    if args.steps % cycle or args.warmup % cycle:
        parser.error(f"--steps and --warmup must be multiples of {cycle}, so that the timed "
                     "runs are whole cycles of every setting.")
    args.optimizer = "sgd"
    args.side = step_time.model_side(args.mb, args.vars)
    nbytes = 4 * args.vars * args.side * args.side
    examples = step_time.ROWS_PER_REPLICA * args.nodes
    table = summarize(measure(args), examples)
    for line in table:
        print(f"{line['builder']} accumulation {line['steps']}: {_ms(line['per_example'])} ms "
              f"per example, speed-up {line.get('speedup', float('nan')):.2f}x")
    if not args.no_write:
        command = report.command_line("benchmarks/accumulation.py", parser, args)
        report.write_section(args.out, format_markdown(table, args, nbytes, examples, command),
                             BEGIN, END)
        print(f"wrote the accumulation section of {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
