"""A table larger than any one node: Keras ``fit`` on a memory-capped emulated cluster,
saved, and loaded into a single-device model in plain Keras.

The model is ``embeddings.py``'s (``Input(8 ids) -> Embedding(ROWS, 64) -> mean ->
Dense(256, relu) -> Dense(1)``, mean squared error, ``SGD(0.01)``) with a table of
``--rows`` rows, by default 14M (3.3 GiB of float32): more than a node's cap.

Setting: ``--nodes`` (4) emulated nodes at 1 Gbit/s, one CPU replica each, each
host in a memory cgroup capped at ``--memory`` (3 GiB, no swap: ``autodist
emulate up --memory``). Every node fits ``--steps`` batches of 256 rows of its
own data (ids uniform over the table); then the chief writes
``model.save_weights`` to a directory every node shares (one machine here).

Systems, each run on a fresh cluster:

* ``--builders`` (``PartitionedPS``) keep the table in parts, one per node:
  each must train and save under the cap;
* ``--replicating`` (``AllReduce``, ``Parallax``) keep a copy of the table on
  every node (``Parallax`` on a cluster reads its parameter servers through a
  local proxy of every part, as the README says): the spec gives every node
  its cap as ``memory``, so each must be refused before training, by a
  ``StrategyError`` naming the node, with no process killed.

Check: with the cluster removed, plain Keras on this machine (uncapped) trains
the same model, from the same seed, on the global batches (the nodes' batches
one after the other, in node order) and saves it; another process loads that
file and each saved one into a fresh model: every weight must equal
single-device training (``TOLERANCE``).

Reported per system: the outcome, fit's median step (after ``WARMUP``
batches), the save's seconds and the file's size, every process's peak
resident memory (``VmHWM``) after ``fit`` and after the save, the hosts' OOM
kills, and the check.

Usage (root, iproute2, a memory cgroup controller):
    python benchmarks/table_over_node.py                  # writes docs/benchmarks.md
    python benchmarks/table_over_node.py --rows 2000000 --memory 1g --steps 4 --no-write
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time

import report
import embeddings
import keras_step_time as kst

report.use_job_environment()  # before TensorFlow loads
REPO = report.REPO

BEGIN = "<!-- table_over_node:begin -->"
END = "<!-- table_over_node:end -->"
TITLE, ANCHOR = next(s for s in report.SECTIONS if s[0].endswith("(`table_over_node`)"))
CLUSTER_NAME = "adbig"
REFUSAL = "does not fit node"  # in the StrategyError of a strategy a node cannot hold
BANDWIDTH = "1gbit"
BATCH = embeddings.ROWS_PER_NODE
WARMUP = 2
TOLERANCE = 1e-5
_TAG = "TABLE_OVER_NODE "
_CHECK_TAG = "TABLE_OVER_NODE_CHECK "
_GiB = 2 ** 30


# --------------------------------------------------------------------------- the jobs

def node_data(args, node: int):
    return embeddings.OneTable(args.rows).data(node, BATCH * args.steps)


def job_autodist(args) -> None:
    """One node's part: fit, then (the chief) save; every process prints one line."""
    kst.limit_threads()
    import keras

    from autodist import AutoDist
    from autodist.strategy import get_builder

    ad = AutoDist(resource_spec_file=args.spec, strategy_builder=get_builder(args.builder))
    x, y = node_data(args, ad.node_index)
    keras.utils.set_random_seed(0)  # the single-device check's initial weights
    with ad.scope():
        model = embeddings.OneTable(args.rows).build("sgd")
    timer = kst.batch_timer(WARMUP)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=[timer])
    after_fit = kst.peak_rss_gb()
    start = time.perf_counter()
    model.save_weights(args.save_to)  # the chief's alone; a worker's writes nothing
    kst.print_line(_TAG + json.dumps({  # every node prints one, into the chief's output
        "process": ad.node_index, "chief": ad.is_chief,
        "median_s": statistics.median(timer.times) if timer.times else None,
        "save_s": time.perf_counter() - start, "fit_peak_gb": after_fit,
        "save_peak_gb": kst.peak_rss_gb()}))


def job_plain(args) -> None:
    """Single-device Keras on the global batches; its weights saved to ``--save-to``."""
    import numpy as np
    import keras

    kst.limit_threads()
    parts = [node_data(args, node) for node in range(args.nodes)]
    steps = [slice(s * BATCH, (s + 1) * BATCH) for s in range(args.steps)]
    x = np.concatenate([p[0][rows] for rows in steps for p in parts])
    y = np.concatenate([p[1][rows] for rows in steps for p in parts])
    keras.utils.set_random_seed(0)
    model = embeddings.OneTable(args.rows).build("sgd")
    model.fit(x, y, batch_size=BATCH * args.nodes, epochs=1, verbose=0, shuffle=False)
    model.save_weights(args.save_to)


def job_check(args) -> None:
    """Every saved file loaded into a plain Keras model, compared with ``--save-to``'s."""
    import numpy as np

    kst.limit_threads()
    model = embeddings.OneTable(args.rows).build("sgd")
    model.load_weights(args.save_to)
    want = [v.numpy() for v in model.weights]
    for path in args.check:
        model.load_weights(path)
        diff = max(float(np.max(np.abs(v.numpy() - w))) for v, w in zip(model.weights, want))
        print(_CHECK_TAG + json.dumps({"path": path, "max_abs_diff": diff}), flush=True)


# --------------------------------------------------------------------------- the driver

def run_system(system: str, args, directory: str) -> dict:
    """One job of ``system`` on a fresh capped cluster; its row."""
    import yaml
    from autodist.cluster import emulate

    path = os.path.join(directory, f"{system}.weights.h5")
    emulate.down(CLUSTER_NAME)  # one left behind by an interrupted run
    with emulate.emulated_cluster(args.nodes, BANDWIDTH, name=CLUSTER_NAME,
                                  cpus_per_node=[1] * args.nodes,
                                  memory=args.memory) as cluster:
        spec = os.path.join(directory, "spec.yml")
        with open(spec, "w", encoding="utf-8") as f:
            yaml.safe_dump(emulate.spec_dict(cluster), f)
        argv = cluster.hosts[0].launch_prefix + [
            sys.executable, os.path.abspath(__file__), "--_job", "autodist", "--spec", spec,
            "--builder", system, "--rows", str(args.rows), "--steps", str(args.steps),
            "--nodes", str(args.nodes), "--save-to", path]
        start = time.perf_counter()
        (code, out, err), = kst.collect([kst.start_job(argv, kst.job_env())], args.timeout)
        row = {"system": system, "job_s": time.perf_counter() - start,
               "oom_kills": [emulate.oom_kills(host) for host in cluster.hosts]}
    processes = sorted((json.loads(line[len(_TAG):]) for line in out.splitlines()
                        if line.startswith(_TAG)), key=lambda p: p["process"])
    if code == 0 and len(processes) == args.nodes and os.path.exists(path):
        chief = next(p for p in processes if p["chief"])
        row.update(ok=True, path=path, median_s=chief["median_s"], save_s=chief["save_s"],
                   file_gb=os.path.getsize(path) / _GiB,
                   fit_peak_gb=[p["fit_peak_gb"] for p in processes],
                   save_peak_gb=[p["save_peak_gb"] for p in processes])
    elif code == -signal.SIGKILL:
        # The chief itself was killed: nothing of AutoDist's is left to say why.
        row.update(ok=False, error="the chief's process was killed by SIGKILL (see the hosts' "
                                   "OOM kills)")
    else:
        lines = [line for line in (err or "").splitlines() if line.strip()
                 and not line.startswith(("E0000", "I0000", "W0000"))]
        row.update(ok=False, error=(lines or [f"exit {code}"])[-1][:400])
        sys.stderr.write(f"--- {system} (exit {code}):\n{out[-2000:]}\n{err[-4000:]}\n")
    print(f"[{system}] " + (f"trained and saved: median step {row['median_s'] * 1e3:.1f} ms, "
                            f"save {row['save_s']:.1f} s, peak RSS per node after fit "
                            + " ".join(f"{g:.2f}" for g in row["fit_peak_gb"]) + " GB, after "
                            "save " + " ".join(f"{g:.2f}" for g in row["save_peak_gb"]) + " GB"
                            if row["ok"] else f"failed: {row['error']}")
          + f"; OOM kills per host {row['oom_kills']} (job {row['job_s']:.0f} s)", flush=True)
    return row


def check(rows: list, args, directory: str) -> dict:
    """path -> the largest difference from single-device training, by plain Keras jobs
    (training, then loading: one process each, so that this machine holds both)."""
    paths = [row["path"] for row in rows if row.get("ok")]
    if not paths:
        return {}
    common = [sys.executable, os.path.abspath(__file__), "--rows", str(args.rows), "--steps",
              str(args.steps), "--nodes", str(args.nodes), "--save-to",
              os.path.join(directory, "single_device.weights.h5")]
    (code, _, err), = kst.collect([kst.start_job(common + ["--_job", "plain"], kst.job_env())],
                                  args.timeout)
    if code != 0:
        sys.stderr.write(f"--- single-device training (exit {code}):\n{err[-4000:]}\n")
        return {}
    (code, out, err), = kst.collect(
        [kst.start_job(common + ["--_job", "check", "--check", *paths], kst.job_env())],
        args.timeout)
    found = {}
    for line in out.splitlines():
        if line.startswith(_CHECK_TAG):
            result = json.loads(line[len(_CHECK_TAG):])
            found[result["path"]] = result["max_abs_diff"]
    if code != 0:
        sys.stderr.write(f"--- check (exit {code}):\n{err[-4000:]}\n")
    return found


def _gb(values: list) -> str:
    return " / ".join(f"{v:.2f}" for v in values)


def format_section(rows: list, diffs: dict, args, command: str, info: dict,
                   elapsed: float) -> str:
    from autodist.resource_spec import parse_memory
    cap_gb = parse_memory(args.memory) / _GiB
    table_gb = embeddings.table_gb(args.rows)
    share_gb = table_gb / args.nodes
    trained = [r for r in rows if r["system"] in args.builders]
    refused = [r for r in rows if r["system"] in args.replicating]
    met_train = all(r["ok"] and diffs.get(r["path"], float("inf")) <= TOLERANCE
                    for r in trained)
    met_refuse = all(not r["ok"] and REFUSAL in r["error"] and not any(r["oom_kills"])
                     for r in refused)
    killed = [r for r in rows if any(r["oom_kills"])]
    table = ["| system | outcome | median step | save | file | peak RSS per node after fit, "
             "GB | after save, GB | OOM kills per host | max diff. from one device |",
             "|---|---|--:|--:|--:|---|---|---|--:|"]
    for r in rows:
        if r["ok"]:
            diff = diffs.get(r["path"])
            table.append(
                f"| {r['system']} | trained and saved | {r['median_s'] * 1e3:.0f} ms | "
                f"{r['save_s']:.1f} s | {r['file_gb']:.2f} GiB | {_gb(r['fit_peak_gb'])} | "
                f"{_gb(r['save_peak_gb'])} | {r['oom_kills']} | "
                + ("not checked" if diff is None else f"{diff:.1e}") + " |")
        else:
            error = re.sub(r"^(\w+\.)+(?=\w+Error:)", "", r["error"])  # no module path
            table.append(f"| {r['system']} | failed: {error.replace('|', '/')} | | | | | "
                         f"| {r['oom_kills']} | |")
    lines = [
        BEGIN, f"## {TITLE}", "",
        f"**Measures:** Keras `fit` of `embeddings`' model with a table of {args.rows:,} rows "
        f"({table_gb:.2f} GiB of float32) and SGD on {args.nodes} emulated nodes at 1 Gbit/s, "
        f"each capped at {cap_gb:g} GiB (a memory cgroup, no swap), {args.steps} batches of "
        f"{BATCH} rows per node; then the chief's `model.save_weights`, loaded into a plain "
        "Keras model on this machine and compared with single-device training on the global "
        "batches.", "",
        f"**Goal** (issue 31): a table larger than a node's cap trains under "
        f"{', '.join(f'`{b}`' for b in args.builders)}, and its file loads into plain Keras "
        f"equal to single-device training (within {TOLERANCE:g}); a strategy replicating the "
        f"table ({', '.join(f'`{b}`' for b in args.replicating)}) is refused before training, "
        f"by name, from the nodes' `memory` in the spec (`autodist emulate` writes the caps "
        f"there). **Result:** training and check {'**met**' if met_train else '**missed**'}; "
        f"replicating strategies "
        f"{'**refused by name**' if met_refuse else '**not all refused by name**'}.",
        "",
        *table, "",
        f"- Each node's share of the table is {share_gb:.2f} GiB; peaks are `VmHWM` per "
        "process, in node order (node 0 is the chief).",
        *([f"- {', '.join('`' + r['system'] + '`' for r in killed)}: a process was killed "
           "by the cap (the chief's own kill leaves no process to name the cause)."]
          if killed else []),
        "- A refusal compares the training state each node would store (copies of the "
        "variables and their optimizer slots, as each synchronizer kind lays them out) with "
        "the node's `memory`; it happens on the chief before any worker starts.",
        "- The save fetches the table in pieces of at most "
        "`autodist.keras.function.PIECE_BYTES` and writes them into the file's dataset; the "
        "chief's model never holds the table.", "",
        f"Measured {info['date']} on {info['cores']} cores ({info['cpu']}), shared by the "
        f"nodes; TensorFlow {info['tf']}, Keras {kst.keras_version()}, Python "
        f"{info['python']}; the run took {elapsed / 60:.0f} min.", "",
        f"Command (root, iproute2, a memory cgroup controller): `{command}`", "", END]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4, help="emulated nodes")
    parser.add_argument("--memory", default="3g", help="each host's memory cap")
    parser.add_argument("--rows", type=int, default=14_000_000, help="the table's rows")
    parser.add_argument("--steps", type=int, default=12, help="batches each node fits")
    parser.add_argument("--builders", nargs="*", default=["PartitionedPS"],
                        help="builders that keep the table in parts (must train)")
    parser.add_argument("--replicating", nargs="*", default=["AllReduce", "Parallax"],
                        help="builders that replicate the table (must fail, named)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per job")
    parser.add_argument("--out", default=os.path.join(REPO, "docs", "benchmarks.md"))
    parser.add_argument("--no-write", action="store_true", help="only print the table")
    parser.add_argument("--_job", choices=("autodist", "plain", "check"), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--builder", help=argparse.SUPPRESS)
    parser.add_argument("--save-to", help=argparse.SUPPRESS)
    parser.add_argument("--check", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._job == "autodist":  # pylint: disable=protected-access
        job_autodist(args)
        return 0
    if args._job in ("plain", "check"):  # pylint: disable=protected-access
        (job_plain if args._job == "plain" else job_check)(args)  # pylint: disable=protected-access
        return 0
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=os.path.join(REPO, ".."),
                                     prefix=".table_over_node.") as directory:
        rows = [run_system(s, args, directory) for s in args.builders + args.replicating]
        diffs = check(rows, args, directory)
    for row in rows:
        if row.get("path") in diffs:
            print(f"[{row['system']}] max |difference| from single-device training: "
                  f"{diffs[row['path']]:.2e}")
    section = format_section(rows, diffs, args, report.command_line(
        "benchmarks/table_over_node.py", parser, args), report.machine_info(),
        time.perf_counter() - start)
    print(section)
    if not args.no_write:
        report.write_section(args.out, section, BEGIN, END)
        report.add_contents_entry(args.out, TITLE, ANCHOR)
    return 0


if __name__ == "__main__":
    sys.exit(main())
