"""Keras ``model.fit`` step time under AutoDist's builders, side by side with tf.distribute.

The model: an MLP 1024 -> 2048 -> 2048 -> 2048 -> 10 (ReLU; 10.5 M float32
weights, 42 MB), SGD (learning rate 0.01), sparse categorical cross-entropy
from logits, on synthetic numpy data; every replica processes 8 rows per step.

Settings, each system against its tf.distribute peer:

* ``one_node``: one node, 2 CPU replicas (spec: ``localhost``, cpus [0, 1]).
  AutoDist fits 16 rows per step (``batch_size=16``), split 8 + 8 across the
  replicas; the peer is ``tf.distribute.MirroredStrategy`` over two logical CPU
  devices (``/cpu:0``, ``/cpu:1``), fitting the same 16-row global batches.
* ``cluster``: 4 emulated nodes (``autodist emulate``: network namespaces,
  links shaped to 1 Gbit/s each way), one CPU replica each. AutoDist's chief
  runs inside the first namespace and launches the other nodes; each node fits
  its own rows with ``batch_size=8``. The peer is
  ``tf.distribute.MultiWorkerMirroredStrategy`` (default
  ``CommunicationOptions``), one worker per namespace with its ``TF_CONFIG``;
  each worker fits a ``tf.data.Dataset`` of its own rows in 32-row global
  batches with ``auto_shard_policy = OFF``, so the strategy gives the worker's
  replica its 8-row slice of each batch (the job checks the per-replica size;
  the other 24 rows of each batch go unused). So both systems train on
  32-row global batches, 8 rows per replica, each node on its own rows.
  Keras 3's ``fit`` fails under a multi-worker MultiWorkerMirroredStrategy
  (keras-team/keras#20585); the peer's model class works around it without
  changing the training step (``_mwms_sequential``).

Method: every measured run is a fresh process (a job; on the cluster, a fresh
job on every node). Rounds are interleaved: round 1 runs every system once,
then round 2, and so on. In a job a Keras callback times
``on_train_batch_begin`` -> ``on_train_batch_end`` of each batch after
``--warmup`` warm-up batches (which include tracing, AutoDist's graph rewrite
and session, joining the cluster), for ``--timed`` batches, and the job prints
the median. A system's figure is the median over rounds of those medians; the
ratio vs. the peer is peer_time / autodist_time, i.e. AutoDist's step rate over
the peer's (above 1: AutoDist is faster). Every job runs with
``AUTODIST_INTRA_OP_THREADS=1 AUTODIST_INTER_OP_THREADS=2`` and the same limits
set through ``tf.config.threading`` (1 intra-op, 2 inter-op threads), so both
systems get the same threads. The timer reads no weights, and says so
(``autodist_reads_weights = False``), so AutoDist's ``fit`` does not copy the
trained weights back into the Keras model after every batch, as it would for
a callback that may read them; the copy at the end of ``fit`` is not timed.

Goals (from the issue): on 4 nodes, AutoDist's best builder reaches at least
1.2x MultiWorkerMirroredStrategy's step rate; on one node it is on par with
MirroredStrategy (taken here as a ratio of at least ``PAR_RATIO``).

Usage (root, iproute2, for the cluster setting):
    python benchmarks/keras_step_time.py                          # both settings, writes docs
    python benchmarks/keras_step_time.py --rounds 1 --timed 5 --no-write
    python benchmarks/keras_step_time.py --settings cluster --builders AllReduce

The tables are printed and, unless ``--no-write``, written into ``--out``
between ``<!-- keras_step_time:begin -->`` and ``<!-- keras_step_time:end -->``.
The emulated cluster is always removed, even after an error.
"""
from __future__ import annotations

import argparse
import contextlib
import json
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

BEGIN = "<!-- keras_step_time:begin -->"
END = "<!-- keras_step_time:end -->"
SETTINGS = ("one_node", "cluster")
PEERS = {"one_node": "MirroredStrategy", "cluster": "MultiWorkerMirroredStrategy"}
TITLES = {"one_node": "One node, 2 CPU replicas",
          "cluster": "4 emulated nodes at 1 Gbit/s, 1 CPU replica each"}
DEFAULT_BUILDERS = ("AllReduce", "PS", "PartitionedPS")
CLUSTER_NAME = "adkb"
NUM_NODES = 4
BANDWIDTH = "1gbit"
ONE_NODE_REPLICAS = 2
ROWS_PER_REPLICA = 8
LAYERS = (1024, 2048, 2048, 2048, 10)
GOAL_CLUSTER = 1.2
PAR_RATIO = 0.9
"""One node: "on par" means AutoDist's best builder runs at least this share of the peer's rate."""
MWMS_PORT = 15710
"""First port of the MultiWorkerMirroredStrategy workers; each run takes the next one."""
_RESULT_TAG = "KERAS_STEP_RESULT "
_CPU_TAG = "KERAS_STEP_CPU "
"""Every process of a job prints one line with this tag: its own CPU seconds per timed step."""


# --------------------------------------------------------------------------- the jobs

def limit_threads() -> None:
    """The same thread limits as AutoDist's sessions, for the process's eager runtime."""
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(int(os.environ["AUTODIST_INTRA_OP_THREADS"]))
    tf.config.threading.set_inter_op_parallelism_threads(int(os.environ["AUTODIST_INTER_OP_THREADS"]))


def build_model(sequential=None, wrap_optimizer=None):
    """The MLP, compiled with SGD and a cross-entropy from logits (call inside a scope).

    Only the API Keras 2 and Keras 3 share, so a peer running TensorFlow 2.15's
    Keras 2 (``peers.py``'s Horovod job) builds the same model.

    Args:
        sequential: the model class, ``keras.Sequential`` unless given.
        wrap_optimizer: called on the SGD optimizer, its result compiled in
            (e.g. ``hvd.DistributedOptimizer``); the optimizer itself unless given.
    """
    import keras
    layers = ([keras.Input((LAYERS[0],))] +
              [keras.layers.Dense(n, activation="relu") for n in LAYERS[1:-1]] +
              [keras.layers.Dense(LAYERS[-1])])
    return compiled((sequential or keras.Sequential)(layers), wrap_optimizer)


def compiled(model, wrap_optimizer=None):
    """``model`` compiled with SGD (learning rate 0.01) and a cross-entropy from logits,
    the training every benchmark model of these scripts gets; ``wrap_optimizer`` as
    in :func:`build_model`."""
    import keras
    optimizer = keras.optimizers.SGD(0.01)
    model.compile(optimizer=wrap_optimizer(optimizer) if wrap_optimizer else optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def synthetic_data(seed: int, rows: int):
    """Synthetic (x, y): uniform inputs, random labels of the 10 classes."""
    import numpy as np
    rng = np.random.RandomState(seed)
    return (rng.rand(rows, LAYERS[0]).astype(np.float32),
            rng.randint(0, LAYERS[-1], size=rows).astype(np.int32))


def _process_cpu_s() -> float:
    """CPU seconds (user + system) this process has used, all its threads included."""
    times = os.times()
    return times.user + times.system


def batch_timer(warmup: int):
    """A callback timing every batch from ``on_train_batch_begin`` to ``on_train_batch_end``.

    It also takes the process's CPU time from the first timed batch's begin to the
    last one's end (``cpu_s``), the work of every thread of the process.
    """
    import keras

    class BatchTimer(keras.callbacks.Callback):
        autodist_reads_weights = False  # AutoDist need not copy the weights per batch

        def __init__(self):
            super().__init__()
            self.times, self.losses, self._start = [], [], 0.0
            self.cpu_s, self._cpu_start = 0.0, None

        def on_train_batch_begin(self, batch, logs=None):
            if batch == warmup:
                self._cpu_start = _process_cpu_s()
            self._start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            elapsed = time.perf_counter() - self._start
            if batch >= warmup:
                self.times.append(elapsed)
                self.cpu_s = _process_cpu_s() - self._cpu_start
            self.losses.append(float((logs or {}).get("loss", float("nan"))))

    return BatchTimer()


def print_line(text: str) -> None:
    """Prints ``text`` and its newline in one write: a job's processes share one output, and
    print()'s separate writes of a line and of its newline interleave with theirs (two
    processes' tagged lines ran into one)."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (text + "\n").encode())


def print_result(system: str, timer) -> None:
    print_line(_RESULT_TAG + json.dumps({
        "system": system, "median_s": statistics.median(timer.times), "times": timer.times,
        "first_loss": timer.losses[0], "last_loss": timer.losses[-1]}))


def peak_rss_gb() -> float:
    """This process's peak resident memory so far, in GiB (``VmHWM``, Linux).

    Not ``getrusage``'s ``ru_maxrss``: that one keeps the peak of the process
    that started this one (Linux carries it over ``exec``), so a worker an
    AutoDist chief launches would report at least the chief's peak.
    """
    try:
        with open("/proc/self/status", encoding="utf-8") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        import resource
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 2 ** 20


def print_cpu(system: str, process: int, timer) -> None:
    """This process's CPU seconds per timed step and its peak memory so far (every process
    of a job prints one)."""
    print_line(_CPU_TAG + json.dumps({"system": system, "process": process,
                                      "cpu_s_per_step": timer.cpu_s / max(1, len(timer.times)),
                                      "peak_rss_gb": peak_rss_gb()}))


AUTO = "AutoStrategy"
"""A builder name of the jobs besides the registered ones: AutoStrategy's pick by its
simulator alone (``trials=0``, so no trial runs inside the timed job; any
``key=value`` after it is passed on, e.g. ``AutoStrategy:trials=8``)."""


def parse_builder(text: str) -> tuple[str, dict]:
    """``report.parse_builder``, with :data:`AUTO` a name too."""
    return report.parse_builder(text, extra_names=(AUTO,))


def strategy_builder(text: str, rows_per_replica: int):
    """The builder object a job's ``--builder`` names."""
    from autodist.strategy import get_builder
    name, kwargs = parse_builder(text)
    if name != AUTO:
        return get_builder(name, **kwargs)
    from autodist.search.builder import AutoStrategy
    options = {"trials": 0, "progress": False, "batch_size": rows_per_replica,
               "log_dir": tempfile.mkdtemp(prefix="autodist_search.")}
    return AutoStrategy(**{**options, **kwargs})


def job_autodist(spec: str, builder: str, warmup: int, timed: int, build=build_model,
                 data=synthetic_data, rows_per_replica: int = ROWS_PER_REPLICA,
                 wrap_builder=None) -> None:
    """One node's part of an AutoDist run (the chief also launches the others); the chief prints.

    Args:
        build: makes the compiled model, as :func:`build_model` (which it defaults to).
        data: ``data(seed, rows)`` -> (x, y), as :func:`synthetic_data`.
        rows_per_replica: the rows each replica processes per step.
        wrap_builder: turns the builder ``builder`` names into the one run, or None.
    """
    limit_threads()
    import keras

    from autodist import AutoDist

    chosen = strategy_builder(builder, rows_per_replica)
    ad = AutoDist(resource_spec_file=spec,
                  strategy_builder=wrap_builder(chosen) if wrap_builder else chosen)
    num_nodes = len(ad.resource_spec.nodes)
    replicas = len(ad.resource_spec.replica_devices)
    if replicas % num_nodes:
        raise ValueError(f"keras_step_time: the spec's {replicas} replicas do not split evenly "
                         f"over its {num_nodes} nodes; give every node as many CPUs.")
    batch = rows_per_replica * replicas // num_nodes  # this node's rows per step
    x, y = data(ad.node_index, batch * (warmup + timed))
    keras.utils.set_random_seed(0)  # the same initial weights on every node and in every system
    with ad.scope():
        model = build()
    timer = batch_timer(warmup)
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False, callbacks=[timer])
    print_cpu(builder, ad.node_index, timer)  # a worker's stdout is the chief's
    if ad.is_chief:
        print_result(builder, timer)


def job_mirrored(warmup: int, timed: int, build=build_model, data=synthetic_data,
                 rows_per_replica: int = ROWS_PER_REPLICA) -> None:
    """MirroredStrategy over two logical CPU devices of this process (arguments as for
    :func:`job_autodist`)."""
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * ONE_NODE_REPLICAS)
    limit_threads()
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(ONE_NODE_REPLICAS)])
    time_one_process_fit(PEERS["one_node"], strategy.scope(), warmup, timed, build, data,
                         rows_per_replica * ONE_NODE_REPLICAS)


def time_one_process_fit(system: str, scope, warmup: int, timed: int, build, data,
                         batch: int) -> None:
    """Times ``fit`` of ``build()``'s model, built in ``scope``, on ``data``'s first
    ``batch * (warmup + timed)`` rows (seed 0) in batches of ``batch``, in this one
    process, and prints ``system``'s result."""
    import keras
    x, y = data(0, batch * (warmup + timed))
    keras.utils.set_random_seed(0)
    with scope:
        model = build()
    timer = batch_timer(warmup)
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False, callbacks=[timer])
    print_cpu(system, 0, timer)
    print_result(system, timer)


def _mwms_sequential():
    """``keras.Sequential`` made to run ``fit`` under a multi-worker strategy.

    Keras 3's ``fit`` fails under ``MultiWorkerMirroredStrategy`` with several
    workers (keras-team/keras#20585, open) in two places, which this class
    works around; the training step itself stays Keras's own:

    * before the first step, ``fit`` builds the loss and metrics from the first
      batch, got by ``strategy.reduce("MEAN", (x, y))``, which that strategy
      rejects for a nested value ("Attempt to convert a value (PerReplica...)
      ... to a Tensor"): the class builds from the local replica's values
      instead (only their shapes and dtypes matter there);
    * after each step, ``fit`` averages every log over the replicas with
      ``strategy.reduce("MEAN", log, axis=0)``, which fails for a scalar
      ("Invalid reduction dimension 0 for input with 0 dimensions"): the step
      returns its scalar logs as vectors of one element, whose average over
      axis 0 is the same mean, still all-reduced every step.
    """
    import keras
    import tensorflow as tf

    class Sequential(keras.Sequential):
        def _maybe_symbolic_build(self, iterator=None, data_batch=None):
            if iterator is not None:
                for _, _, batches in iterator:
                    data_batch = tf.nest.map_structure(
                        lambda v: self.distribute_strategy.experimental_local_results(v)[0],
                        next(batches))
                    break
            return super()._maybe_symbolic_build(data_batch=data_batch)

        def train_step(self, data):
            return tf.nest.map_structure(lambda v: tf.reshape(v, [-1]) if v.shape.rank == 0 else v,
                                         super().train_step(data))

    return Sequential


def job_mwms(warmup: int, timed: int, build=build_model, data=synthetic_data,
             rows_per_replica: int = ROWS_PER_REPLICA) -> None:
    """One worker of a MultiWorkerMirroredStrategy run (``TF_CONFIG`` set by the driver;
    arguments as for :func:`job_autodist`, ``build`` taking the model class first)."""
    limit_threads()
    import keras
    import tensorflow as tf
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions())
    global_batch = rows_per_replica * strategy.num_replicas_in_sync
    # Each worker reads all of its own dataset (no auto-sharding) in global batches and
    # takes its replica's slice of each: rows_per_replica of its own rows per step.
    x, y = data(task, global_batch * (warmup + timed))
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch).with_options(options)
    first = next(iter(strategy.experimental_distribute_dataset(dataset)))
    rows = {int(t.shape[0]) for t in strategy.experimental_local_results(first[0])}
    if rows != {rows_per_replica}:
        raise RuntimeError(f"keras_step_time: a MultiWorkerMirroredStrategy replica gets {rows} "
                           f"rows per step, not {rows_per_replica}.")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build(_mwms_sequential())
    timer = batch_timer(warmup)
    model.fit(dataset, epochs=1, verbose=0, shuffle=False, callbacks=[timer])
    print_cpu(PEERS["cluster"], task, timer)
    if task == 0:
        print_result(PEERS["cluster"], timer)


# --------------------------------------------------------------------------- the driver

def _job_argv(kind: str, args, *extra: str) -> list:
    return [sys.executable, os.path.abspath(__file__), "--_job", kind, *extra,
            "--warmup", str(args.warmup), "--timed", str(args.timed)]


def job_env(**extra: str) -> dict:
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def start_job(argv: list, env: dict) -> subprocess.Popen:
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)


def stop_job(proc: subprocess.Popen) -> None:
    """Ends a job's process group: SIGTERM (an AutoDist chief then stops its workers), then SIGKILL."""
    for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
            proc.communicate(timeout=grace)
        except ProcessLookupError:
            break
        except subprocess.TimeoutExpired:
            continue


def collect(procs: list, timeout: float) -> list:
    """(returncode, stdout, stderr) of every process; none outlives ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for proc in procs:
            try:
                out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
                outputs.append((proc.returncode, out, err))
            except subprocess.TimeoutExpired:
                stop_job(proc)
                outputs.append((None, "", f"timed out after {timeout:.0f} s"))
    finally:
        for proc in procs:  # also after Ctrl-C: no job may outlive the cluster
            stop_job(proc)
    return outputs


def job_result(system: str, outputs: list) -> dict:
    """The result line of the first process's stdout, or an error row quoting stderr.

    The row's ``cpu_s_per_step`` lists the CPU line of every process that printed
    one (an AutoDist worker prints on its chief's stdout), in process order, and
    ``peak_rss_gb`` those processes' peak memory.
    """
    code, out, _ = outputs[0]
    for line in out.splitlines():
        if line.startswith(_RESULT_TAG):
            row = json.loads(line[len(_RESULT_TAG):])
            cpu = [json.loads(l[len(_CPU_TAG):]) for _, o, _ in outputs
                   for l in (o or "").splitlines() if l.startswith(_CPU_TAG)]
            cpu.sort(key=lambda c: c["process"])
            row["cpu_s_per_step"] = [c["cpu_s_per_step"] for c in cpu]
            row["peak_rss_gb"] = [c["peak_rss_gb"] for c in cpu if "peak_rss_gb" in c]
            return row
    for i, (c, o, e) in enumerate(outputs):
        sys.stderr.write(f"--- {system}, process {i} (exit {c}):\n{o[-2000:]}\n{e[-6000:]}\n")
    lines = [l for l in outputs[0][2].splitlines() if l.strip()]
    return {"system": system, "error": (lines or [f"exit {code}"])[-1][:300]}


def run_one_node(system: str, spec: str, args, job_argv=None) -> dict:
    """One job of the one_node setting: a builder, or MirroredStrategy.

    ``job_argv(kind, args, *extra)`` is the job's command (default: this script's
    job of that kind, ``--_job kind``); the cluster's likewise.
    """
    job_argv = job_argv or _job_argv
    argv = (job_argv("mirrored", args) if system == PEERS["one_node"]
            else job_argv("autodist", args, "--spec", spec, "--builder", system))
    return job_result(system, collect([start_job(argv, job_env())], args.timeout))


def run_cluster(system: str, spec: str, cluster, args, port: int, job_argv=None) -> dict:
    """One job of the cluster setting: AutoDist's chief in the first namespace, or MWMS workers."""
    job_argv = job_argv or _job_argv
    if system != PEERS["cluster"]:
        argv = cluster.hosts[0].launch_prefix + job_argv("autodist", args, "--spec", spec,
                                                         "--builder", system)
        return job_result(system, collect([start_job(argv, job_env())], args.timeout))
    workers = [f"{h.address}:{port}" for h in cluster.hosts]
    procs = []
    for i, host in enumerate(cluster.hosts):
        config = json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}})
        procs.append(start_job(host.launch_prefix + job_argv("mwms", args),
                               job_env(TF_CONFIG=config)))
    return job_result(system, collect(procs, args.timeout))


def run_rounds(setting: str, systems: list, run, rounds: int, rotate: bool = False) -> dict:
    """Runs every system once per round, rounds interleaved; system -> list of job results.

    With ``rotate``, round r starts at the r-th system (in the given order), so no
    system always runs first, or always right after the same other one.
    """
    results = {s: [] for s in systems}
    for r in range(rounds):
        shift = r % len(systems) if rotate else 0
        for system in systems[shift:] + systems[:shift]:
            start = time.perf_counter()
            row = run(system)
            row["job_s"] = time.perf_counter() - start
            results[system].append(row)
            status = (f"median {row['median_s'] * 1e3:.1f} ms, loss {row['first_loss']:.3f} -> "
                      f"{row['last_loss']:.3f}" if "median_s" in row else
                      row["error"] if row.get("skipped") else f"FAILED: {row['error']}")
            if row.get("cpu_s_per_step"):
                status += (", CPU s/step per process " +
                           " ".join(f"{c:.3f}" for c in row["cpu_s_per_step"]))
            print(f"[{setting} round {r + 1}/{rounds}] {system}: {status} "
                  f"(job {row['job_s']:.0f} s, load {os.getloadavg()[0]:.1f})", flush=True)
    return results


@contextlib.contextmanager
def setting_spec(setting: str, cluster_name: str = CLUSTER_NAME):
    """Yields (the setting's resource spec file, its emulated cluster or None for one_node).

    ``one_node``: this machine, ``ONE_NODE_REPLICAS`` CPU replicas. ``cluster``:
    ``NUM_NODES`` emulated nodes at ``BANDWIDTH``, one CPU replica each, named
    ``cluster_name``; one left behind by an interrupted run is removed first, and
    the cluster is removed on exit, even after an error.
    """
    import yaml
    with tempfile.TemporaryDirectory() as tmp:
        spec = os.path.join(tmp, "spec.yml")
        if setting == "one_node":
            with open(spec, "w", encoding="utf-8") as f:
                yaml.safe_dump({"nodes": [{"address": "localhost",
                                           "cpus": list(range(ONE_NODE_REPLICAS)),
                                           "chief": True}]}, f)
            yield spec, None
            return
        from autodist.cluster import emulate
        emulate.down(cluster_name)  # one left behind by an interrupted run of this script
        with emulate.emulated_cluster(NUM_NODES, BANDWIDTH, name=cluster_name,
                                      cpus_per_node=[1] * NUM_NODES) as cluster:
            with open(spec, "w", encoding="utf-8") as f:
                yaml.safe_dump(emulate.spec_dict(cluster), f)
            yield spec, cluster


def measure(setting: str, builders: list, args) -> dict:
    """Measures one setting; system -> list of job results (the peer last)."""
    systems = list(builders) + [PEERS[setting]]
    with setting_spec(setting) as (spec, cluster):
        if cluster is None:
            return run_rounds(setting, systems, lambda s: run_one_node(s, spec, args), args.rounds)
        ports = iter(range(MWMS_PORT, MWMS_PORT + 1000))
        return run_rounds(setting, systems,
                          lambda s: run_cluster(s, spec, cluster, args, next(ports)),
                          args.rounds)


# --------------------------------------------------------------------------- the report

def summarize(results: dict, peer: str) -> list:
    """Rows: system, median over rounds of the jobs' medians, steps/s, ratio vs. the peer."""
    rows = []
    for system, runs in results.items():
        medians = [r["median_s"] for r in runs if "median_s" in r]
        errors = [r["error"] for r in runs if "error" in r]
        row = {"system": system, "rounds": medians, "errors": errors, "peer": system == peer}
        if medians:
            row["median_s"] = statistics.median(medians)
            row["steps_per_s"] = 1.0 / row["median_s"]
        rows.append(row)
    peer_row = next(r for r in rows if r["peer"])
    for row in rows:
        if "median_s" in row and "median_s" in peer_row:
            row["ratio"] = peer_row["median_s"] / row["median_s"]
    return rows


def _cells(row: dict, markdown: bool) -> list:
    name = f"`{row['system']}`" if markdown else row["system"]
    if row["peer"]:
        name += " (peer)" if not markdown else " (tf.distribute)"
    if "median_s" not in row:
        error = (f"failed: {row['errors'][0]}" if row["errors"] else "not run").replace("|", "/")
        return [name, error] + ["", ""] if markdown else [name, error[:60], "", "", ""]
    ratio = "1.00x" if row["peer"] else (f"{row['ratio']:.2f}x" if "ratio" in row else "")
    cells = [name, f"{row['median_s']:.4f}", f"{row['steps_per_s']:.2f}", ratio]
    if not markdown:
        cells.append(" ".join(f"{t * 1e3:.1f}" for t in row["rounds"]))
    if row["errors"]:
        cells[-1] += f" ({len(row['errors'])} failed)"
    return cells


_COLUMNS = ("system", "median step s", "steps/s", "ratio vs peer")


def format_text(rows: list) -> str:
    header = list(_COLUMNS) + ["per-round medians ms"]
    body = [_cells(r, False) for r in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *body)]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(line, widths)))
                     for line in [header] + body)


def format_table(rows: list) -> str:
    lines = ["| " + " | ".join(_COLUMNS) + " |", "|---|--:|--:|--:|"]
    lines += ["| " + " | ".join(_cells(r, True)) + " |" for r in rows]
    return "\n".join(lines)


SHORT = {"one_node": "One node", "cluster": "4 nodes"}


def verdict(setting: str, rows: list):
    """(met: True/False/None, one short sentence) for the setting's goal, about the best builder."""
    measured = [r for r in rows if not r["peer"] and "ratio" in r]
    peer = PEERS[setting]
    goal = GOAL_CLUSTER if setting == "cluster" else PAR_RATIO
    wanted = (f">= {GOAL_CLUSTER}x" if setting == "cluster" else f"on par (>= {PAR_RATIO}x)")
    if not measured:
        return None, f"{SHORT[setting]}: goal {wanted} vs `{peer}` not measured."
    best = max(measured, key=lambda r: r["ratio"])
    met = best["ratio"] >= goal
    return met, (f"{SHORT[setting]}: best builder `{best['system']}` at {best['ratio']:.2f}x "
                 f"`{peer}`'s step rate; goal {wanted} {'**met**' if met else '**not met**'}.")


def format_section(tables: dict, args, start_load: str, info: dict, elapsed: float) -> str:
    lines = [BEGIN, "## Keras fit step time vs tf.distribute (`keras_step_time`)", "",
             f"Median `model.fit` step of an MLP {' -> '.join(map(str, LAYERS))} (42 MB of float32 "
             f"weights, SGD, {ROWS_PER_REPLICA} rows per replica per step) under AutoDist's "
             "builders and under its tf.distribute peer, each run a fresh job, rounds interleaved; "
             "*ratio vs peer* = peer step time / AutoDist step time (above 1: AutoDist is faster).",
             "", "Command: `python benchmarks/keras_step_time.py" +
             ("".join(f" {a}" for a in _nondefault_args(args))) + "`", "",
             f"Measured {info['date']} on {info['cores']} cores ({info['cpu']}), TensorFlow "
             f"{info['tf']}, Keras {keras_version()}, Python {info['python']}; median of "
             f"{args.rounds} rounds, each job {args.warmup} warm-up + {args.timed} timed batches, "
             f"1 intra-op / 2 inter-op threads per process; 1-minute load average {start_load} at "
             f"the start, {info['load']} at the end (other work on the machine inflates the "
             f"figures); the run took {elapsed / 60:.0f} min.", ""]
    findings = []
    for setting, rows in tables.items():
        lines += [f"**{TITLES[setting]}** (peer: `{PEERS[setting]}`)", "", format_table(rows), ""]
        findings.append(verdict(setting, rows)[1])
    lines += [f"- {f}" for f in findings[:3]] + [END]
    return "\n".join(lines)


def add_job_args(parser: argparse.ArgumentParser) -> None:
    """The options of the scripts that run this module's jobs: rounds, batches, timeout."""
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: 3)")
    parser.add_argument("--warmup", type=int, default=5,
                        help="warm-up batches per job (default: 5)")
    parser.add_argument("--timed", type=int, default=20, help="timed batches per job (default: 20)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds per job (default: 300)")


def check_job_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exits through ``parser.error`` unless rounds and batches are at least 1."""
    if args.rounds < 1 or args.timed < 1 or args.warmup < 1:
        parser.error("--rounds, --timed and --warmup must be at least 1 (the first batch traces).")


def _nondefault_args(args) -> list:
    out = []
    if args.settings != list(SETTINGS):
        out += ["--settings", *args.settings]
    if args.builders != list(DEFAULT_BUILDERS):
        out += ["--builders", *args.builders]
    for name, default in (("rounds", 3), ("warmup", 5), ("timed", 20)):
        if getattr(args, name) != default:
            out += [f"--{name}", str(getattr(args, name))]
    return out


def keras_version() -> str:
    from importlib import metadata
    return metadata.version("keras")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS),
                        help="which settings to measure (default: both)")
    parser.add_argument("--builders", nargs="+", default=list(DEFAULT_BUILDERS),
                        help=f"AutoDist builders (default: {' '.join(DEFAULT_BUILDERS)})")
    add_job_args(parser)
    parser.add_argument("--out", default=os.path.join(REPO, "docs", "benchmarks.md"),
                        help="markdown file whose keras_step_time section is rewritten")
    parser.add_argument("--no-write", action="store_true", help="only print the tables")
    parser.add_argument("--_job", choices=("autodist", "mirrored", "mwms"), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--builder", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args._job:  # pylint: disable=protected-access
        job = args._job  # pylint: disable=protected-access
        if job == "autodist":
            job_autodist(args.spec, args.builder, args.warmup, args.timed)
        elif job == "mirrored":
            job_mirrored(args.warmup, args.timed)
        else:
            job_mwms(args.warmup, args.timed)
        return 0

    from autodist.strategy import BUILDERS
    unknown = [b for b in args.builders if b not in BUILDERS]
    if unknown:
        parser.error(f"unknown builder(s) {unknown}; valid names are {sorted(BUILDERS)}.")
    check_job_args(parser, args)
    args.settings = [s for s in SETTINGS if s in args.settings]
    start, start_load = time.perf_counter(), report.machine_info()["load"]
    tables = {}
    for setting in args.settings:
        tables[setting] = summarize(measure(setting, args.builders, args), PEERS[setting])
    elapsed = time.perf_counter() - start
    info = report.machine_info()
    outcomes = []
    for setting, rows in tables.items():
        met, sentence = verdict(setting, rows)
        outcomes.append(met)
        print(f"\n{TITLES[setting]} (median of {args.rounds} rounds; ratio = peer time / time)")
        print(format_text(rows))
        print(sentence.replace("**", ""))
    print(f"\nload average {start_load} at the start, {info['load']} at the end; "
          f"run took {elapsed:.0f} s")
    if not args.no_write:
        report.write_section(args.out, format_section(tables, args, start_load, info, elapsed),
                             BEGIN, END)
        print(f"wrote the keras_step_time section of {args.out}")
    return 1 if False in outcomes else 0


if __name__ == "__main__":
    sys.exit(main())
