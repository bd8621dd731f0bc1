"""Per-iteration time of every strategy builder on an emulated, bandwidth-limited cluster.

The model is communication-bound on purpose: a few large dense variables (by
default 4 x [1792, 1792] float32, about 51 MB) behind a negligible forward pass
(a [2, 1792] input through a chain of matmuls, plain SGD by default), so a step's time is
essentially the time to synchronize the gradients. Each builder is compared
with the ring all-reduce bound

    2 (n - 1) / n * bytes / bandwidth

the time a bandwidth-optimal all-reduce of ``bytes`` needs on ``n`` nodes whose
links carry ``bandwidth`` each way. The goal (from the issue): AllReduce stays
within 1.3x of it. A compressor that puts float16 on the wire is compared with
the bound at half the bytes too.

How a case runs: the driver builds an emulated cluster (``autodist emulate``:
network namespaces, tc-shaped links, one CPU replica per node), then for each
builder starts this same file in job mode as the chief, inside the first
namespace; AutoDist launches it on the other nodes. Every node does the warm-up
steps, then the timed ones; the chief prints the step times, which the driver
parses. The cluster is always removed, even after an error.

Usage (root, iproute2):
    python benchmarks/step_time.py                                  # all builders, writes docs
    python benchmarks/step_time.py --builders AllReduce PS --no-write
    python benchmarks/step_time.py --builders AllReduce:chunk_size=1,compressor=HorovodCompressor
    python benchmarks/step_time.py --builders tf_collective:chunks=4 --floor-bandwidth none

A builder is ``Name`` or ``Name:key=value,key=value`` (values in Python syntax,
bare words taken as strings); ``tf_collective`` is TensorFlow's collective alone
(see ``RAW``). After the main cluster, ``--floor-builders`` run again with
``--floor-bandwidth`` links, so fast that what remains is the CPU's share.

The table is printed and, unless ``--no-write``, written into ``--out`` between
``<!-- step_time:begin -->`` and ``<!-- step_time:end -->`` (the rest of the file
is left alone).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import report

report.use_job_environment()  # before TensorFlow loads
REPO = report.REPO
ENV = report.JOB_ENV

BEGIN = "<!-- step_time:begin -->"
END = "<!-- step_time:end -->"
GOAL_RATIO = 1.3
GOAL_BUILDER = "AllReduce"
CLUSTER_NAME = "adstep"
DEFAULT_BUILDERS = (
    "PS", "PSLoadBalancing", "PartitionedPS", "UnevenPartitionedPS",
    "AllReduce", "AllReduce:chunk_size=1",
    "AllReduce:compressor=HorovodCompressor", "AllReduce:chunk_size=1,compressor=HorovodCompressor",
    "PartitionedAR", "PartitionedAR:chunk_size=4", "RandomAxisPartitionAR", "Parallax",
    "tf_collective", "tf_collective:chunks=4", "tf_collective:chunks=16", "tf_collective:subdivs=4",
)
FLOOR_BUILDERS = ("AllReduce", "AllReduce:chunk_size=1")
FP16_COMPRESSORS = ("HorovodCompressor", "HorovodCompressorEF")
ROWS_PER_REPLICA = 2
_RESULT_TAG = "STEP_TIME_RESULT "
RAW = "tf_collective"
"""Pseudo-builder: TensorFlow's CollectiveReduceV2 on the same bytes, without AutoDist.

Arguments: ``chunks`` (collectives the bytes are split into, default 1), ``dtype``
(``float32`` or ``float16`` on the wire), ``hint`` (``communication_hint``,
default ``auto``) and ``subdivs`` (``max_subdivs_per_device``: -1, TF's default
and AutoDist's, is one ring pass per collective; 0 lets TF pick up to 2; k > 0
up to k concurrent sub-rings of smaller pieces). It separates what TensorFlow's
ring costs on this cluster from what AutoDist adds around it."""
RAW_PORT = 15490


# --------------------------------------------------------------------------- builders

def parse_builder(text: str) -> tuple[str, dict]:
    """``report.parse_builder``, with ``tf_collective`` (``RAW``) a name too."""
    return report.parse_builder(text, extra_names=(RAW,))


def wire_fraction(kwargs: dict) -> float:
    """Bytes on the wire per gradient byte: 0.5 for a float16 compressor, else 1."""
    return 0.5 if kwargs.get("compressor") in FP16_COMPRESSORS else 1.0


# --------------------------------------------------------------------------- the job (every node)

def model_side(megabytes: float, num_vars: int) -> int:
    """Side of the square float32 variables: ``num_vars`` of them make about ``megabytes`` MB.

    Rounded to a multiple of 64 (TF's kernels and the ring's chunks like round sizes).
    """
    side = math.sqrt(megabytes * 1e6 / 4 / num_vars)
    return max(64, int(round(side / 64)) * 64)


OPTIMIZERS = ("sgd", "adam")


def _build_model(num_vars: int, side: int, optimizer: str = "sgd"):
    """A chain of ``num_vars`` [side, side] matmuls on a tiny batch; SGD (or Adam).

    Returns (x, loss, train)."""
    import tensorflow as tf
    v1 = tf.compat.v1
    x = v1.placeholder(tf.float32, [None, side], name="x")
    h = x
    init = v1.random_normal_initializer(stddev=1.0 / math.sqrt(side), seed=0)
    for i in range(num_vars):
        w = v1.get_variable(f"layer_{i}/kernel", [side, side], initializer=init)
        h = tf.tanh(tf.matmul(h, w))
    loss = tf.reduce_mean(tf.square(h - 0.5), name="loss")
    chosen = (v1.train.AdamOptimizer(1e-3) if optimizer == "adam"
              else v1.train.GradientDescentOptimizer(0.1))
    train = chosen.minimize(loss, name="train")
    return x, loss, train


def _slot_bytes_here(session, node_index: int) -> int:
    """Bytes of the Adam slots on this node's devices (its shards' only, for a sharded update)."""
    import tensorflow as tf
    task = f"/task:{node_index}/"
    return sum(v.shape.num_elements() * v.dtype.size
               for v in session.distributed.graph.get_collection(
                   tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
               if v.op.name.rsplit("/", 1)[-1] in ("Adam", "Adam_1") and task in v.device)


def run_job(spec: str, builder: str, num_vars: int, side: int, warmup: int, steps: int,
            optimizer: str = "sgd", accumulation_steps: int = 1) -> None:
    """One node's part of a case; the chief prints the result line."""
    import numpy as np
    import tensorflow as tf

    from autodist import AutoDist
    from autodist.strategy import get_builder

    name, kwargs = parse_builder(builder)
    ad = AutoDist(spec, get_builder(name, **kwargs), accumulation_steps=accumulation_steps)
    rows = ROWS_PER_REPLICA * sum(1 for r in ad.resource_spec.replica_devices
                                  if r.host_address == _my_address(ad))
    batch = np.random.RandomState(ad.node_index).rand(rows, side).astype(np.float32)
    result = {"builder": builder}
    with tf.Graph().as_default(), ad.scope():
        x, loss, train = _build_model(num_vars, side, optimizer)
        start = time.perf_counter()
        session = ad.create_distributed_session()
        result["session_s"] = time.perf_counter() - start
        result["chief_slot_bytes"] = _slot_bytes_here(session, ad.node_index)
        before = session.run(loss, {x: batch})
        start = time.perf_counter()
        for _ in range(warmup):
            session.run(train, {x: batch})
        result["warmup_s"] = time.perf_counter() - start
        times = []
        cpu, machine = _process_cpu_s(), _machine_cpu()
        start = time.perf_counter()
        for _ in range(steps):
            step = time.perf_counter()
            session.run(train, {x: batch})
            times.append(time.perf_counter() - step)
        result["wall_s"] = time.perf_counter() - start
        result["chief_cpu_s"] = (_process_cpu_s() - cpu) / steps
        result["machine_busy"] = _busy_fraction(machine, _machine_cpu())
        result["loss_decreased"] = bool(session.run(loss, {x: batch}) < before)
        result["times"] = times
        session.close()
    if ad.is_chief:
        print(_RESULT_TAG + json.dumps(result), flush=True)


def run_raw_job(hosts: list, task: int, nbytes: int, options: dict, warmup: int,
                steps: int) -> None:
    """One node of a ``tf_collective`` case: a plain TF server and CollectiveReduceV2 ops."""
    import tensorflow as tf
    v1 = tf.compat.v1
    chunks = int(options.get("chunks", 1))
    wire = tf.float16 if options.get("dtype") == "float16" else tf.float32
    config = v1.ConfigProto()
    config.intra_op_parallelism_threads = int(os.environ["AUTODIST_INTRA_OP_THREADS"])
    config.inter_op_parallelism_threads = int(os.environ["AUTODIST_INTER_OP_THREADS"])
    config.experimental.collective_group_leader = "/job:worker/replica:0/task:0"
    cluster = tf.train.ClusterSpec({"worker": [f"{h}:{RAW_PORT}" for h in hosts]})
    server = tf.distribute.Server(cluster, job_name="worker", task_index=task, config=config)
    with tf.Graph().as_default():
        with tf.device(f"/job:worker/replica:0/task:{task}/device:CPU:0"):
            per_chunk = nbytes // 4 // chunks
            source = tf.Variable(tf.random.uniform([chunks, per_chunk], seed=task), name="grads")
            reduced = []
            for c in range(chunks):
                reduced.append(tf.raw_ops.CollectiveReduceV2(
                    input=tf.cast(source[c], wire), group_size=len(hosts), group_key=1,
                    instance_key=c + 1, ordering_token=[], merge_op="Add", final_op="Div",
                    communication_hint=options.get("hint", "auto"),
                    max_subdivs_per_device=int(options.get("subdivs", -1))))
            step_op = tf.group(*[tf.cast(r, tf.float32) for r in reduced])
            barrier = tf.raw_ops.CollectiveReduceV2(
                input=tf.ones([1]), group_size=len(hosts), group_key=1, instance_key=chunks + 1,
                ordering_token=[], merge_op="Add", final_op="Id")
        session = v1.Session(server.target, config=config)
        session.run(source.initializer)
        for _ in range(warmup):
            session.run(step_op)
        times = []
        cpu, machine = _process_cpu_s(), _machine_cpu()
        start = time.perf_counter()
        for _ in range(steps):
            step = time.perf_counter()
            session.run(step_op)
            times.append(time.perf_counter() - step)
        wall = time.perf_counter() - start
        result = {"times": times, "wall_s": wall, "session_s": float("nan"),
                  "chief_cpu_s": (_process_cpu_s() - cpu) / steps,
                  "machine_busy": _busy_fraction(machine, _machine_cpu())}
        session.run(barrier)  # nobody leaves while a peer still needs its data
    if task == 0:
        print(_RESULT_TAG + json.dumps(result), flush=True)
    time.sleep(2.0)
    os._exit(0)  # a TF server cannot be stopped; don't wait for its threads


def _process_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def _machine_cpu() -> tuple[int, int]:
    """(busy, total) jiffies of all cores from /proc/stat; namespaces do not hide other work."""
    with open("/proc/stat", encoding="utf-8") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _busy_fraction(before: tuple[int, int], after: tuple[int, int]) -> float:
    """Share of the machine's CPU time that was busy between two ``_machine_cpu`` samples."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total else float("nan")


def _my_address(ad) -> str:
    from autodist.cluster.runtime import ordered_nodes
    return ordered_nodes(ad.resource_spec)[ad.node_index]


# --------------------------------------------------------------------------- the driver

def run_case(cluster, spec: str, builder: str, args) -> dict:
    """Runs one builder's job on the cluster; returns its row (or an error row)."""
    command = [*cluster.hosts[0].launch_prefix, sys.executable, os.path.abspath(__file__),
               "--_job", spec, builder, "--vars", str(args.vars), "--side", str(args.side),
               "--warmup", str(args.warmup), "--steps", str(args.steps),
               "--optimizer", getattr(args, "optimizer", "sgd"),
               "--accumulation-steps", str(getattr(args, "accumulation_steps", 1))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        return {"builder": builder, "error": f"timed out after {args.timeout:.0f} s"}
    except BaseException:
        _stop(proc)  # Ctrl-C: no job may outlive the cluster
        raise
    elapsed = time.perf_counter() - start
    for line in out.splitlines():
        if line.startswith(_RESULT_TAG):
            row = json.loads(line[len(_RESULT_TAG):])
            row["job_s"] = elapsed
            return row
    sys.stderr.write(f"--- {builder} failed (exit {proc.returncode}):\n{out[-3000:]}\n{err[-6000:]}\n")
    lines = [l for l in err.strip().splitlines() if l.strip()]
    return {"builder": builder, "error": (lines or [f"exit {proc.returncode}"])[-1][:200]}


def _stop(proc: subprocess.Popen) -> None:
    """Stops a job's process group: SIGTERM first (a chief then stops its workers), then SIGKILL."""
    for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.communicate(timeout=grace)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def run_raw_case(cluster, builder: str, nbytes: int, args) -> dict:
    """Runs a ``tf_collective`` case: the driver starts one plain TF process per host."""
    _, options = parse_builder(builder)
    hosts = json.dumps([h.address for h in cluster.hosts])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen(
        [*host.launch_prefix, sys.executable, os.path.abspath(__file__), "--_raw", hosts, str(i),
         builder, "--raw-bytes", str(nbytes), "--warmup", str(args.warmup), "--steps", str(args.steps)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
        for i, host in enumerate(cluster.hosts)]
    deadline = time.monotonic() + args.timeout
    outputs = []
    try:
        for proc in procs:
            try:
                outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                outputs.append(("", "timed out"))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    for line in outputs[0][0].splitlines():
        if line.startswith(_RESULT_TAG):
            return {"builder": builder, **json.loads(line[len(_RESULT_TAG):])}
    sys.stderr.write(f"--- {builder} failed:\n" + "\n".join(err[-3000:] for _, err in outputs) + "\n")
    return {"builder": builder, "error": "failed (see stderr)"}


def ring_bound(num_nodes: int, nbytes: float, gbit: float) -> float:
    """Seconds a bandwidth-optimal ring all-reduce of ``nbytes`` needs at ``gbit`` Gbit/s per link."""
    return 2 * (num_nodes - 1) / num_nodes * nbytes / (gbit * 1e9 / 8)


def summarize(row: dict, num_nodes: int, nbytes: int, gbit: float) -> dict:
    """Adds median/mean step time, the bounds and the ratios to a measured row."""
    if "times" not in row:
        return row
    _, kwargs = parse_builder(row["builder"])
    times = row["times"]
    row["median_s"] = statistics.median(times)
    row["mean_s"] = row["wall_s"] / len(times)
    row["min_s"] = min(times)
    row["bound_s"] = ring_bound(num_nodes, nbytes, gbit)
    row["ratio"] = row["median_s"] / row["bound_s"]
    fraction = 0.5 if kwargs.get("dtype") == "float16" else wire_fraction(kwargs)
    if fraction != 1.0:
        row["wire_bound_s"] = ring_bound(num_nodes, nbytes * fraction, gbit)
        row["wire_ratio"] = row["median_s"] / row["wire_bound_s"]
    return row


def measure_links(spec: str) -> list:
    """TCP throughput chief <-> every node (``autodist probe``), or [] if it fails."""
    from autodist.cluster import probe
    from autodist.resource_spec import ResourceSpec
    try:
        return probe.probe(ResourceSpec(spec), seconds=1.0, pings=10)
    except Exception as err:  # a benchmark aid only; the run goes on without it
        print(f"warning: probing the links failed: {err}", file=sys.stderr)
        return []


# --------------------------------------------------------------------------- reporting

_COLUMNS = ("builder", "median s/iter", "mean s/iter", "min s", "ring bound s", "ratio",
            "ratio at wire bytes", "chief CPU s/iter", "machine busy", "session s")


def _cells(row: dict) -> list:
    if "times" not in row:
        return [row["builder"], row.get("error", "failed")] + [""] * (len(_COLUMNS) - 2)
    wire = (f"{row['wire_ratio']:.2f} (bound {row['wire_bound_s']:.3f} s)"
            if "wire_ratio" in row else "")
    session = "" if math.isnan(row["session_s"]) else f"{row['session_s']:.1f}"
    return [row["builder"], f"{row['median_s']:.3f}", f"{row['mean_s']:.3f}", f"{row['min_s']:.3f}",
            f"{row['bound_s']:.3f}", f"{row['ratio']:.2f}", wire, f"{row['chief_cpu_s']:.2f}",
            f"{row['machine_busy']:.0%}", session]


def format_text(rows: list) -> str:
    body = [_cells(r) for r in rows]
    widths = [max(len(x) for x in col) for col in zip(_COLUMNS, *body)]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                       enumerate(zip(line, widths))) for line in [list(_COLUMNS)] + body]
    return "\n".join(lines)


def _row(rows: list, builder: str):
    """The measured row of ``builder``, or None."""
    return next((r for r in rows if r["builder"] == builder and "median_s" in r), None)


def goal_verdict(rows: list):
    """(holds, sentence) for the default ``AllReduce``; other uncompressed AllReduce
    settings are listed too. (None, reason) when the default was not run."""
    listed = [r for r in rows if parse_builder(r["builder"])[0] == GOAL_BUILDER
              and wire_fraction(parse_builder(r["builder"])[1]) == 1.0]
    goal = next((r for r in listed if r["builder"] == GOAL_BUILDER), None)
    parts = []
    for row in listed:
        if "ratio" not in row:
            parts.append(f"`{row['builder']}` failed ({row.get('error')})")
        else:
            parts.append(f"`{row['builder']}` {row['median_s']:.3f} s = {row['ratio']:.2f}x "
                         f"({'met' if row['ratio'] <= GOAL_RATIO else 'MISSED'})")
    if goal is None:
        return None, "; ".join(parts) or f"the default {GOAL_BUILDER} was not run"
    return "ratio" in goal and goal["ratio"] <= GOAL_RATIO, "; ".join(parts)


NOTES = "notes/step_time.md"  # relative to the docs page


def _findings(rows: list, floor_rows: list, args, nbytes: int) -> list:
    """Short findings on the figures this run measured; the reasoning behind them is in NOTES."""
    n, gbit = args.nodes, args.gbit
    chunk_mb = nbytes / n / 1e6
    out = []
    default, raw = _row(rows, GOAL_BUILDER), _row(rows, RAW)
    if default and raw:
        overhead = default["median_s"] / raw["median_s"] - 1
        lead = ("AutoDist adds little to TensorFlow's own collective" if overhead < 0.1 else
                f"AutoDist is {overhead:.0%} slower than TensorFlow's own collective")
        from autodist.strategy import all_reduce_builders, common
        buckets = collectives(GOAL_BUILDER, args.vars, nbytes // args.vars, n)
        reduce = ("`CollectiveReduceV2`" if gbit <= all_reduce_builders.COLLECTIVE_UP_TO_GBPS
                  else "scatter-gather")
        out.append(
            f"{lead}: default `AllReduce` ({nbytes / 1e6:.1f} MB of gradients in {buckets} "
            f"bucket(s) of at most {common.DEFAULT_BUCKET_BYTES / 2 ** 20:.0f} MiB, one "
            f"{reduce} each) "
            f"{default['median_s']:.3f} s, one collective of all the bytes in bare TF "
            f"(`{RAW}`) {raw['median_s']:.3f} s. Bare TF makes one ring "
            f"pass, each of its 2(n-1) = {2 * (n - 1)} steps copying a whole {chunk_mb:.1f} MB "
            f"chunk (of {n}) before forwarding it; AutoDist's 4 sub-rings per device overlap "
            f"([why]({NOTES}#where-the-time-goes)).")
    split = [r for r in rows if "median_s" in r
             and _is_split(r["builder"], args.vars, nbytes // args.vars, n)]
    if split:
        best = min(split, key=lambda r: r["median_s"])
        worst = max(split, key=lambda r: r["median_s"])
        out.append(
            "Several collectives instead of one overlap one piece's copying with another's "
            f"transfer: the {len(split)} cases that split the bytes take "
            f"{best['median_s']:.3f} to {worst['median_s']:.3f} s (rows above); best "
            f"`{best['builder']}`, {best['ratio']:.2f}x the bound"
            + ("; the splits land within 15% of each other, so what remains is not the "
               "ring's shape." if max(r["median_s"] for r in split) < 1.15 * best["median_s"]
               else "."))
    ar = [r for r in rows if "machine_busy" in r and _is_all_reduce(r["builder"])]
    measured = [r for r in floor_rows if "median_s" in r]
    if measured:
        figures = ", ".join(f"`{r['builder']}` {r['median_s']:.3f} s (machine "
                            f"{r['machine_busy']:.0%} busy)" for r in measured)
        busy = (f"; at {args.bandwidth} the all-reduce rows kept it "
                f"{min(r['machine_busy'] for r in ar):.0%} to "
                f"{max(r['machine_busy'] for r in ar):.0%} busy" if ar else "")
        out.append(
            f"CPU floor: with {args.floor_bandwidth} links the steps still take {figures}, "
            f"the CPU cost of all-reducing {nbytes / 1e6:.0f} MB on {os.cpu_count()} cores "
            f"shared by {n} TensorFlow processes{busy} ([more]({NOTES}#cpu-floor)).")
    ps = _row(rows, "PS")
    out.append(
        f"One parameter server must receive, then send, (n-1) x bytes: "
        f"{(n - 1) * nbytes / (gbit * 1e9 / 8):.2f} s each way"
        + (f" (`PS` {ps['median_s']:.3f} s, {ps['ratio']:.2f}x)" if ps else "")
        + "; sharding over all nodes moves as many bytes per link as the ring.")
    return out


def _is_all_reduce(builder: str) -> bool:
    name, kwargs = parse_builder(builder)
    return name in (RAW, "AllReduce", "PartitionedAR", "RandomAxisPartitionAR", "Parallax") \
        and wire_fraction(kwargs) == 1.0 and kwargs.get("dtype") != "float16"


def collectives(builder: str, num_vars: int, var_bytes: int, num_replicas: int) -> int:
    """How many dense collectives an all-reduce builder launches for the model.

    The model's variables are alike, so their order does not matter: the builder's
    buckets (``bucket_bytes``, ``chunk_size``) over its units (variables, or parts).
    """
    from autodist.strategy import common
    name, kwargs = parse_builder(builder)
    parts = 1 if name in ("AllReduce", "Parallax") else \
        int(kwargs.get("num_partitions") or max(2, num_replicas))
    units = [(i, var_bytes // parts, 0) for i in range(num_vars * parts)]
    buckets = common.byte_buckets(units, kwargs.get("bucket_bytes", common.DEFAULT_BUCKET_BYTES),
                                  kwargs.get("chunk_size"))
    return max(buckets.values()) + 1


def _is_split(builder: str, num_vars: int, var_bytes: int, num_replicas: int) -> bool:
    """Whether an uncompressed all-reduce case uses several collectives (or sub-rings)."""
    if not _is_all_reduce(builder):
        return False
    name, kwargs = parse_builder(builder)
    if name == RAW:
        return int(kwargs.get("chunks", 1)) > 1 or int(kwargs.get("subdivs", -1)) != -1
    return collectives(builder, num_vars, var_bytes, num_replicas) > 1


def format_markdown(rows: list, floor_rows: list, info: dict, args, nbytes: int,
                    links: list, command: str = "python benchmarks/step_time.py") -> str:
    holds, verdict = goal_verdict(rows)
    status = {True: "the goal **holds**", False: "the goal **does not hold**",
              None: "not measured"}[holds]
    n, gbit = args.nodes, args.gbit
    env = " ".join(f"{k}={os.environ[k]}" for k in ENV)
    bad = [r["builder"] for r in rows + floor_rows if r.get("loss_decreased") is False]
    sanity = ("The loss went down for every builder." if not bad else
              f"The loss did NOT go down for {bad}.")
    floor = []
    if floor_rows:
        floor = ["", f"Same cases with {args.floor_bandwidth} links (ring bound "
                 f"{ring_bound(n, nbytes, emulate_rate(args.floor_bandwidth)):.3f} s):", "",
                 *_markdown_table(floor_rows)]
    return "\n".join([
        BEGIN,
        "## Step time vs. the ring all-reduce bound (`step_time`)",
        "",
        f"**Measures:** seconds per step of each builder on an emulated {n}-node cluster "
        f"({args.bandwidth} links each way, 1 CPU replica per node) for a communication-bound "
        f"model ({args.vars} float32 variables of [{args.side}, {args.side}], "
        f"{nbytes / 1e6:.1f} MB, behind a [{ROWS_PER_REPLICA}, {args.side}] input; plain SGD), "
        "against the *ring bound* 2(n-1)/n x bytes / bandwidth = "
        f"2 x {n - 1}/{n} x {nbytes / 1e6:.1f} MB / {gbit * 1000 / 8:.0f} MB/s = "
        f"{ring_bound(n, nbytes, gbit):.3f} s, the least any all-reduce needs.",
        "",
        f"**Goal:** `AllReduce` (default arguments) within {GOAL_RATIO}x of the ring bound. "
        f"**Result:** {status} ({verdict}).",
        "",
        f"Measured {info['date']} on {info['cores']} cores ({info['cpu']}) shared by the {n} "
        f"nodes, TensorFlow {info['tf']}, Python {info['python']}, `{env}`; {args.warmup} "
        f"warm-up + {args.steps} timed steps; 1-minute load average {info['load']} at the end. "
        f"{_links_sentence(links)} {sanity}",
        "",
        f"Command (root, iproute2): `{command}` (`--builders AllReduce:chunk_size=1 "
        "--no-write` for one case).",
        "",
        *_markdown_table(rows),
        *floor,
        "",
        "*ratio* = median / ring bound; *ratio at wire bytes*: a float16 compressor against "
        f"the bound at half the bytes; `{RAW}`: the same bytes through TensorFlow's collective "
        f"without AutoDist ([all columns]({NOTES}#columns)).",
        "",
        *[f"- {f}" for f in _findings(rows, floor_rows, args, nbytes)],
        "",
        *([f"{args.notes}", ""] if args.notes else []),
        f"Details: [notes]({NOTES}) (the model and the bound, the columns, where the time "
        "goes, the CPU floor).",
        END,
    ])


def _markdown_table(rows: list) -> list:
    header = "| " + " | ".join(_COLUMNS) + " |"
    align = "|---|" + "--:|" * (len(_COLUMNS) - 1)
    return [header, align] + ["| " + " | ".join(
        (f"`{c}`" if i == 0 else c) for i, c in enumerate(_cells(r))) + " |" for r in rows]


def emulate_rate(rate: str) -> float:
    from autodist.cluster import emulate
    return emulate.parse_rate(rate)




def _links_sentence(links: list) -> str:
    if not links:
        return "The links were not probed."
    rates = [g for m in links for g in (m.to_node_gbit, m.from_node_gbit)]
    return (f"`autodist probe`: {min(rates):.3f} to {max(rates):.3f} Gbit/s of TCP between the "
            "chief and each node.")




# --------------------------------------------------------------------------- main

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--nodes", type=int, default=4, help="emulated nodes (default: 4)")
    parser.add_argument("--bandwidth", default="1gbit",
                        help="link rate each way, tc syntax (default: 1gbit)")
    parser.add_argument("--mb", type=float, default=50.0,
                        help="approximate model size in MB of float32 (default: 50)")
    parser.add_argument("--vars", type=int, default=4, help="number of square variables (default: 4)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (default: 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default: 3)")
    parser.add_argument("--builders", nargs="+", default=list(DEFAULT_BUILDERS),
                        help="builders, Name or Name:key=value,... (default: all)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd",
                        help="the model's optimizer (default: sgd)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per builder (default: 240)")
    parser.add_argument("--name", default=CLUSTER_NAME,
                        help=f"emulated cluster name (default: {CLUSTER_NAME})")
    parser.add_argument("--no-probe", action="store_true", help="do not measure the links first")
    parser.add_argument("--floor-bandwidth", default="10gbit",
                        help="rerun --floor-builders with links this fast, to show the CPU floor "
                             "('none' to skip; default: 10gbit)")
    parser.add_argument("--floor-builders", nargs="*", default=list(FLOOR_BUILDERS),
                        help=f"builders for the CPU-floor run (default: {' '.join(FLOOR_BUILDERS)})")
    parser.add_argument("--notes", default="", help="a paragraph added under the table in the docs")
    parser.add_argument("--out", default=os.path.join(REPO, "docs", "benchmarks.md"),
                        help="markdown file whose step_time section is rewritten")
    parser.add_argument("--no-write", action="store_true", help="only print the table")
    parser.add_argument("--json", help="also save every measured row (step times included) here")
    parser.add_argument("--side", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--_job", nargs=2, metavar=("SPEC", "BUILDER"), help=argparse.SUPPRESS)
    parser.add_argument("--_raw", nargs=3, metavar=("HOSTS", "TASK", "BUILDER"), help=argparse.SUPPRESS)
    parser.add_argument("--raw-bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--accumulation-steps", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args._job:  # pylint: disable=protected-access
        spec, builder = args._job  # pylint: disable=protected-access
        run_job(spec, builder, args.vars, args.side, args.warmup, args.steps, args.optimizer,
                args.accumulation_steps)
        return 0
    if args._raw:  # pylint: disable=protected-access
        hosts, task, builder = args._raw  # pylint: disable=protected-access
        run_raw_job(json.loads(hosts), int(task), args.raw_bytes, parse_builder(builder)[1],
                    args.warmup, args.steps)
        return 0

    from autodist.cluster import emulate
    for builder in args.builders + args.floor_builders:
        try:
            parse_builder(builder)
        except ValueError as err:
            parser.error(str(err))
    if args.nodes < 2:
        parser.error("--nodes must be at least 2: the bound is about a multi-node all-reduce.")
    try:
        args.gbit = emulate.parse_rate(args.bandwidth)
        if args.floor_bandwidth.lower() != "none":
            emulate.parse_rate(args.floor_bandwidth)
    except ValueError as err:
        parser.error(str(err))
    args.side = args.side or model_side(args.mb, args.vars)
    nbytes = 4 * args.vars * args.side * args.side
    print(f"model: {args.vars} x [{args.side}, {args.side}] float32 = {nbytes / 1e6:.1f} MB; "
          f"ring bound on {args.nodes} nodes at {args.gbit:g} Gbit/s: "
          f"{ring_bound(args.nodes, nbytes, args.gbit):.3f} s", flush=True)

    rows, links = run_suite(args.bandwidth, args.builders, args, nbytes, not args.no_probe)
    floor_rows = []
    if args.floor_bandwidth.lower() != "none" and args.floor_builders:
        floor_rows, _ = run_suite(args.floor_bandwidth, args.floor_builders, args, nbytes, False)
    print(format_text(rows))
    if floor_rows:
        print(f"\nWith {args.floor_bandwidth} links:\n" + format_text(floor_rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"rows": rows, "floor_rows": floor_rows, "bytes": nbytes}, f, indent=1)
    holds, verdict = goal_verdict(rows)
    print(f"\nGoal {GOAL_BUILDER} <= {GOAL_RATIO}x ring bound: "
          f"{ {True: 'holds', False: 'DOES NOT HOLD', None: 'not measured'}[holds] } ({verdict})")
    if not args.no_write:
        command = report.command_line("benchmarks/step_time.py", parser, args,
                                      skip=("out", "no_write", "json", "notes"))
        section = format_markdown(rows, floor_rows, report.machine_info(), args, nbytes, links,
                                  command)
        report.write_section(args.out, section, BEGIN, END)
        print(f"wrote the step_time section of {args.out}")
    return 0 if holds is not False else 1


@contextlib.contextmanager
def emulated_spec(nodes: int, bandwidth: str, name: str):
    """An emulated cluster of ``nodes`` at ``bandwidth`` and its spec file: (cluster, path).

    A cluster of that name left behind by an interrupted run goes first; this one
    is always removed, even after an error.
    """
    import yaml

    from autodist.cluster import emulate
    emulate.down(name)
    with tempfile.TemporaryDirectory() as tmp, \
            emulate.emulated_cluster(nodes, bandwidth, name=name) as cluster:
        spec = os.path.join(tmp, "spec.yml")
        with open(spec, "w", encoding="utf-8") as f:
            yaml.safe_dump(emulate.spec_dict(cluster), f)
        yield cluster, spec


def run_suite(bandwidth: str, builders: list, args, nbytes: int, probe_links: bool):
    """Builds the emulated cluster at ``bandwidth``, runs every builder on it, removes it.

    Returns:
        (rows, link measurements or [])
    """
    from autodist.cluster import emulate
    gbit = emulate.parse_rate(bandwidth)
    rows, links = [], []
    with emulated_spec(args.nodes, bandwidth, args.name) as (cluster, spec):
        if probe_links:
            links = measure_links(spec)
            for m in links:
                print(f"link chief<->{m.address}: {m.to_node_gbit:.3f} / {m.from_node_gbit:.3f} "
                      f"Gbit/s, rtt {m.latency_ms:.2f} ms", flush=True)
        for builder in builders:
            print(f"... {builder} at {bandwidth}", file=sys.stderr, flush=True)
            case = (run_raw_case(cluster, builder, nbytes, args) if builder.startswith(RAW)
                    else run_case(cluster, spec, builder, args))
            row = summarize(case, args.nodes, nbytes, gbit)
            if "times" in row:
                print(f"    median {row['median_s']:.3f} s, ratio {row['ratio']:.2f}, chief CPU "
                      f"{row['chief_cpu_s']:.2f} s/step, machine busy {row['machine_busy']:.0%}; "
                      "steps " + " ".join(f"{t:.3f}" for t in row["times"]), file=sys.stderr,
                      flush=True)
            rows.append(row)
    return rows, links


if __name__ == "__main__":
    sys.exit(main())
