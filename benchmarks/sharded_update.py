"""ShardedUpdateAR against AllReduce: optimizer-slot bytes per node, and step time with Adam.

The model is ``step_time.py``'s: 4 float32 variables of [1792, 1792] (51 MB)
behind a negligible forward pass, here with Adam, so that the optimizer's
update (reading and writing each variable, its two slots and its gradient) is a
visible part of a step. The cluster: 4 emulated nodes (``autodist emulate``),
one CPU replica each, links shaped to each ``--bandwidths`` rate both ways.

Method: at each rate the cluster is built once; then rounds are interleaved
(round 1 runs every builder once, then round 2, ...), each run a fresh job
whose chief times ``--steps`` steps after ``--warmup`` warm-up steps and
reports their median. A builder's figure is the median over rounds; the ratio
is AllReduce's time over ShardedUpdateAR's (above 1: sharding is faster). The
chief also reports the bytes of the Adam slots on its own devices.

Usage (root, iproute2):
    python benchmarks/sharded_update.py                      # writes docs/benchmarks.md
    python benchmarks/sharded_update.py --rounds 1 --bandwidths 1gbit --no-write

The table is printed and, unless ``--no-write``, written into ``--out`` between
``<!-- sharded_update:begin -->`` and ``<!-- sharded_update:end -->``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import report
import step_time

report.use_job_environment()  # before TensorFlow loads

BEGIN = "<!-- sharded_update:begin -->"
END = "<!-- sharded_update:end -->"
BUILDERS = ("AllReduce", "ShardedUpdateAR")
CLUSTER_NAME = "adshard"


def measure(bandwidth: str, args) -> dict:
    """Builder -> the chief's rows of every round, on a cluster built at ``bandwidth``."""
    rows = {builder: [] for builder in BUILDERS}
    with step_time.emulated_spec(args.nodes, bandwidth, args.name) as (cluster, spec):
        for round_index in range(args.rounds):
            for builder in BUILDERS:
                row = step_time.run_case(cluster, spec, builder, args)
                if "times" in row:
                    row["median_s"] = statistics.median(row["times"])
                    print(f"{bandwidth} round {round_index + 1} {builder}: "
                          f"{row['median_s']:.3f} s per step, slots on the chief "
                          f"{row['chief_slot_bytes'] / 1e6:.1f} MB", flush=True)
                else:
                    print(f"{bandwidth} round {round_index + 1} {builder}: {row['error']}",
                          flush=True)
                rows[builder].append(row)
    return rows


def summarize(results: dict) -> list:
    """One row per rate: each builder's median step time and slot bytes, and the ratio."""
    table = []
    for bandwidth, rows in results.items():
        line = {"bandwidth": bandwidth}
        for builder, runs in rows.items():
            good = [r for r in runs if "median_s" in r]
            line[builder] = (statistics.median(r["median_s"] for r in good) if good else None)
            line[f"{builder} slots"] = good[0]["chief_slot_bytes"] if good else None
            line[f"{builder} failures"] = len(runs) - len(good)
        if line["AllReduce"] and line["ShardedUpdateAR"]:
            line["ratio"] = line["AllReduce"] / line["ShardedUpdateAR"]
        table.append(line)
    return table


def _seconds(value) -> str:
    return "failed" if value is None else f"{value:.3f}"


def _megabytes(value) -> str:
    return "n/a" if value is None else f"{value / 1e6:.1f}"


def format_markdown(table: list, args, nbytes: int, command: str) -> str:
    info = report.machine_info()
    lines = [
        BEGIN,
        "## Sharded update vs. AllReduce with Adam (`sharded_update`)", "",
        f"**Measures:** on {args.nodes} emulated nodes (one CPU replica each), the model of "
        f"`step_time` ({nbytes / 1e6:.1f} MB of float32) trained with Adam: the Adam slots "
        "each node holds, and the median step time of `ShardedUpdateAR` (each replica "
        "updates its shard) against `AllReduce` (every node updates everything).", "",
        f"Measured {info['date']} on {info['cores']} cores ({info['cpu']}) shared by the "
        f"{args.nodes} nodes, TensorFlow {info['tf']}; median over {args.rounds} interleaved "
        f"rounds of fresh jobs, each the median of {args.steps} steps after {args.warmup} "
        f"warm-up steps; 1-minute load {info['load']} at the end.", "",
        f"Command: `{command}`", "",
        "| link | AllReduce s/step | ShardedUpdateAR s/step | speed-up | Adam slots per node, "
        "AllReduce | Adam slots per node, ShardedUpdateAR |",
        "|---|--:|--:|--:|--:|--:|"]
    for line in table:
        ratio = f"{line['ratio']:.2f}x" if "ratio" in line else "n/a"
        lines.append(f"| {line['bandwidth']} | {_seconds(line['AllReduce'])} | "
                     f"{_seconds(line['ShardedUpdateAR'])} | {ratio} | "
                     f"{_megabytes(line['AllReduce slots'])} MB | "
                     f"{_megabytes(line['ShardedUpdateAR slots'])} MB |")
    lines += ["", "Findings:", ""]
    slots = [line for line in table if line["AllReduce slots"] and line["ShardedUpdateAR slots"]]
    if slots:
        share = slots[0]["ShardedUpdateAR slots"] / slots[0]["AllReduce slots"]
        lines.append(f"- Under `ShardedUpdateAR` each node holds {share:.2f} of AllReduce's Adam "
                     f"slots (1/{args.nodes} for {args.nodes} replicas) and updates that share "
                     "of each variable.")
    timed = [line for line in table if "ratio" in line]
    if timed:
        verdicts = ", ".join(f"{'faster' if line['ratio'] > 1 else 'slower'} at "
                             f"{line['bandwidth']} ({line['ratio']:.2f}x)" for line in timed)
        lines.append(f"- Step time: sharding is {verdicts}.")
    lines += ["- TensorFlow's CPU collectives have no reduce-scatter (it is NCCL-only), so the "
              "sharded update all-reduces the gradient, then all-gathers the shards and writes "
              "them into each node's copy: 1.5x AllReduce's bytes and two more copies of the "
              "model per step, against 1/n of the update's work.",
              END]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--nodes", type=int, default=4, help="emulated nodes (default: 4)")
    parser.add_argument("--bandwidths", nargs="+", default=["1gbit", "5gbit"],
                        help="link rates each way, tc syntax (default: 1gbit 5gbit)")
    parser.add_argument("--mb", type=float, default=50.0,
                        help="approximate model size in MB of float32 (default: 50)")
    parser.add_argument("--vars", type=int, default=4, help="number of square variables (default: 4)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: 3)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per job (default: 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default: 3)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per job (default: 300)")
    parser.add_argument("--name", default=CLUSTER_NAME,
                        help=f"emulated cluster name (default: {CLUSTER_NAME})")
    parser.add_argument("--out", default=os.path.join(report.REPO, "docs", "benchmarks.md"),
                        help="markdown file whose sharded_update section is rewritten")
    parser.add_argument("--no-write", action="store_true", help="only print the table")
    args = parser.parse_args(argv)
    args.optimizer = "adam"
    args.side = step_time.model_side(args.mb, args.vars)
    nbytes = 4 * args.vars * args.side * args.side
    results = {bandwidth: measure(bandwidth, args) for bandwidth in args.bandwidths}
    table = summarize(results)
    for line in table:
        print(f"{line['bandwidth']}: AllReduce {_seconds(line['AllReduce'])} s, "
              f"ShardedUpdateAR {_seconds(line['ShardedUpdateAR'])} s, speed-up "
              f"{line.get('ratio', float('nan')):.2f}x; Adam slots per node "
              f"{_megabytes(line['AllReduce slots'])} vs "
              f"{_megabytes(line['ShardedUpdateAR slots'])} MB")
    if not args.no_write:
        command = report.command_line("benchmarks/sharded_update.py", parser, args)
        report.write_section(args.out, format_markdown(table, args, nbytes, command), BEGIN, END)
        print(f"wrote the sharded_update section of {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
