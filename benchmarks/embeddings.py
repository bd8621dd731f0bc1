"""Embedding tables of growing size: step time and peak memory per node, AutoDist against its peers.

The models (``--model``), as a Keras 3 user writes them, trained with
``model.fit`` on synthetic numpy data; every node fits 256 rows per step:

* ``one_table`` (the default): ``Input((8,), int32 ids) -> Embedding(ROWS, 64) ->
  GlobalAveragePooling1D (the mean of the 8 rows) -> Dense(256, relu) -> Dense(1)``,
  mean squared error; ids drawn uniformly over the whole table (so the 2048 lookups
  of a node's step touch about 2030 distinct rows of a 100k-row table and nearly
  2048 of the larger ones), targets standard normal.
* ``dlrm``: a DLRM-style ranking model (``Dlrm``): 13 dense features through a
  bottom MLP, 4 categorical features of one id each in tables of ROWS, ROWS/4,
  ROWS/16 and ROWS/64 rows, DLRM's dot interaction, a top MLP, binary
  cross-entropy. Issue 57 asks for it with Adagrad (``--optimizers adagrad``). It
  writes its own section; only the memory goal below is checked on it.

Table sizes (``--rows``): 100k, 1M and 10M rows (25.6 MB, 256 MB and 2.56 GB of
float32). Optimizers (``--optimizers``, default all five): Keras ``SGD(0.01)``,
``Adam(0.001)`` (two slots the size of the table), ``adam_lazy`` (the same Adam, with
AutoDist's builders wrapped in ``LazyRowUpdates``; the other systems run Adam as it
is), ``Adagrad(0.01)`` (one slot) and ``Ftrl(0.01)`` (two slots). AutoDist updates
only the rows a step touched where that is exact (SGD, Adagrad, FTRL after its first
step), the whole table with Adam, and the touched rows with lazy Adam.

Settings, each system against the same data:

* ``one_node``: this machine, 2 CPU replicas (``keras_step_time``'s spec, as
  ``configs/local_2cpu.yml``); ``batch_size=256``, 128 rows per replica. Peer:
  ``MirroredStrategy`` over two logical CPU devices (``keras_step_time``'s job).
  Baseline: plain Keras, ``Keras (one device)``: ``model.fit`` with no AutoDist and
  no tf.distribute strategy, on the process's one CPU device, ``batch_size=256``
  (AutoDist's global batch here), with the same data, initial weights, timer and
  thread limits (``job_keras``).
* ``cluster``: 4 emulated nodes at 1 Gbit/s (``autodist emulate``, as
  ``keras_step_time`` and ``peers`` build it), one CPU replica and process per
  node, each node fitting its own rows with ``batch_size=256``. Peers:
  ``MultiWorkerMirroredStrategy`` (``keras_step_time``'s worker job) and Horovod
  0.28.1 with Gloo on TensorFlow 2.15 (``horovod_peer``'s venv and launch; the
  first run builds the venv, about 5 minutes, as ``peers.py --setup-only`` does).

Systems: AutoDist's ``--builders`` (default ``AllReduce PartitionedPS
Parallax AutoStrategy``) and the peers and baseline of ``--systems`` (default all,
each where it applies). ``AutoStrategy`` is its pick by the simulator alone
(``trials=0``, ``keras_step_time.AUTO``), made in each job: a search with trials
restarts the script for every trial, which a timed job cannot hold.

Method: as ``keras_step_time``: every run is a fresh job (on the cluster, a
fresh process on every node); for each table size (smallest first) and
optimizer, rounds are interleaved, each round starting one system later. A job
times the batches after ``--warmup`` with ``keras_step_time``'s timer and
reports the median; a system's figure is the median over rounds. Each process
prints its peak resident memory at the end of ``fit`` (``VmHWM``, see
``keras_step_time.peak_rss_gb``); the tables give the largest over the run's
processes and rounds. *vs peer*: the peer's step time over the system's (above
1: faster than the peer); the peer is Horovod on the cluster, MirroredStrategy
on one node. *vs Keras* (one node): plain Keras's step time over the builder's
(above 1: AutoDist is faster).

Memory: the machine's nodes share its memory, and it has no swap. Before a run
the script estimates each process's peak and skips the run ("skipped: needs ~X
GB") unless processes x estimate fits in the memory available then less
``--reserve-gb``. The estimate, per process, with T the table's bytes and S =
T x (1 + slots): before the system has run with a smaller table, 1 GB + 2 x S
(the Keras model's table and one more copy, with their slots); after one
smaller table, its measured peak there plus 2 x the S it adds; after two, the
line through the two largest measured; for a table it already ran with (an
earlier round), its measured peak. The same rules hold for
plain Keras, whose process holds the table and its slots once: the a-priori
estimate's second copy stands for Keras's own (the table's initial value, the
optimizer's dense temporaries of the table's size). While a job runs,
a watchdog kills it (every process this script started, by id) if the
machine's available memory falls below ``FLOOR_GB``; its row then says so, and
that system is not run with larger tables.

Goals (issue 31), with SGD: ``PartitionedPS`` and ``Parallax`` step time at 10M
rows at most 1.5x their time at 100k rows; the best AutoDist builder at least
2x Horovod's step rate at 1M and 10M rows; the peak memory of every node under
``PartitionedPS`` at most its share of the table (with slots) plus 1.5 GB
(checked with every optimizer run).

Goals (issue 57): on one node with Adagrad and 10M rows, the best AutoDist
builder's step at least 3x as fast as plain Keras's; on the cluster with
Adagrad and 1M rows, the best builder at least 2x Horovod's step rate; with SGD, Adagrad and FTRL,
``PartitionedPS``'s step at 10M rows at most 1.5x its step at 100k on the
cluster (SGD's is issue 31's check; with Adagrad and FTRL the one-node figure is
shown as informative, counted neither met nor missed).

Usage (root and iproute2 for the cluster setting):
    python benchmarks/embeddings.py                        # everything; writes docs
    python benchmarks/embeddings.py --settings one_node --rows 10000 --optimizers sgd \\
        --rounds 1 --timed 3 --no-write
    python benchmarks/embeddings.py --settings one_node --optimizers adagrad \\
        --builders PartitionedPS --systems "Keras (one device)"   # issue 57's 3x goal
    python benchmarks/embeddings.py --settings cluster --builders PartitionedPS --systems
    python benchmarks/embeddings.py --model dlrm --optimizers adagrad   # the DLRM-style model

The tables are printed and, unless ``--no-write``, written into ``--out``
between ``<!-- embeddings:begin -->`` and ``<!-- embeddings:end -->`` (with a
contents entry). The emulated cluster is always removed, even after an error.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import signal
import statistics
import sys
import threading
import time
import traceback

import report
import keras_step_time as kst  # both import only the standard library until a job runs
import horovod_peer

report.use_job_environment()  # before TensorFlow loads
REPO = report.REPO

BEGIN = "<!-- embeddings:begin -->"
END = "<!-- embeddings:end -->"
TITLE, ANCHOR = next(s for s in report.SECTIONS if s[0].endswith("(`embeddings`)"))
NOTES = "notes/peers.md"  # how Horovod and MultiWorkerMirroredStrategy run

IDS_PER_EXAMPLE = 8
DIM = 64
HIDDEN = 256
ROWS_PER_NODE = 256
DEFAULT_ROWS = (100_000, 1_000_000, 10_000_000)
DENSE_FEATURES = 13  # as Criteo's, which DLRM was made for
DLRM_SHARES = (1, 1 / 4, 1 / 16, 1 / 64)
"""The DLRM-style model's tables, in rows over ``--rows``."""


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """A Keras optimizer as the benchmark runs it.

    Attributes:
        keras_class: its class name in ``keras.optimizers``.
        rate: the learning rate.
        slots: its slots the size of the table.
        lazy: AutoDist's builders run under ``LazyRowUpdates`` (the table updated by the
            rows a step looked up, inexactly); the other systems run the optimizer as it is.
    """

    keras_class: str
    rate: float
    slots: int
    lazy: bool = False

    @property
    def label(self) -> str:
        return self.keras_class + (", lazy" if self.lazy else "")


OPTIMIZERS = {"sgd": Optimizer("SGD", 0.01, 0), "adam": Optimizer("Adam", 0.001, 2),
              "adam_lazy": Optimizer("Adam", 0.001, 2, lazy=True),
              "adagrad": Optimizer("Adagrad", 0.01, 1), "ftrl": Optimizer("Ftrl", 0.01, 2)}
"""Every one is run by default."""
DEFAULT_BUILDERS = ("AllReduce", "PartitionedPS", "Parallax", kst.AUTO)
SETTINGS = kst.SETTINGS
HOROVOD = horovod_peer.SYSTEM
MIRRORED, MWMS = kst.PEERS["one_node"], kst.PEERS["cluster"]
PEER_SYSTEMS = (HOROVOD, MIRRORED, MWMS)
KERAS = "Keras (one device)"
"""Plain Keras on one node: ``model.fit`` on one device, no AutoDist, no tf.distribute."""
OTHER_SYSTEMS = PEER_SYSTEMS + (KERAS,)
"""The systems of ``--systems``: every one besides AutoDist's builders."""
SETTING_PEERS = {"one_node": (MIRRORED, KERAS), "cluster": (HOROVOD, MWMS)}
"""The systems of ``OTHER_SYSTEMS`` each setting runs (when ``--systems`` names them)."""
RATIO_PEER = {"one_node": MIRRORED, "cluster": HOROVOD}
"""The peer the *vs peer* column compares with."""
SHORT = {"one_node": "one node", "cluster": f"{kst.NUM_NODES} nodes"}
PROCESSES = {"one_node": 1, "cluster": kst.NUM_NODES}
REPLICAS_PER_NODE = {"one_node": kst.ONE_NODE_REPLICAS, "cluster": 1}
CLUSTER_NAME = "ademb"
MWMS_PORT = 15910

BASE_GB = 1.0
"""The a-priori estimate's memory of a process besides the table: TensorFlow, Keras, AutoDist."""
GROWTH = 2.0
"""The a-priori estimate's bytes per byte of table and slots: the model's copy and one more
(plain Keras's dense Adam peaked at 2.05 x its table and slots at 10M rows)."""
RESERVE_GB = 3.0
FLOOR_GB = 2.0
"""The watchdog stops a job when the machine's available memory falls below this."""

GOAL_SMALL, GOAL_LARGE, GOAL_SCALING = 100_000, 10_000_000, 1.5
HOROVOD_GOALS, GOAL_HOROVOD = (("sgd", 1_000_000), ("sgd", 10_000_000), ("adagrad", 1_000_000)), 2.0
"""(optimizer, table rows) where the best builder steps at least GOAL_HOROVOD x as fast as
Horovod: issue 31's with SGD, issue 57's with Adagrad."""
GOAL_RSS_EXTRA_GB = 1.5
SCALING_GOALS = (("PartitionedPS", "sgd", ()), ("Parallax", "sgd", ()),
                 ("PartitionedPS", "adagrad", ("one_node",)),
                 ("PartitionedPS", "ftrl", ("one_node",)),
                 ("PartitionedPS", "adam_lazy", ("one_node",)),
                 ("PartitionedPS", "adam", SETTINGS))
"""(builder, optimizer, settings where its check is only informative): step at GOAL_LARGE rows
at most GOAL_SCALING x its step at GOAL_SMALL. Issue 31 set it with SGD for both builders;
issue 57 for ``PartitionedPS`` with SGD (the same check), Adagrad, FTRL and lazy Adam on the
cluster, and exact Adam's growth reported (informative everywhere)."""
GOAL_KERAS_OPTIMIZER, GOAL_KERAS_ROWS, GOAL_KERAS = "adagrad", 10_000_000, 3.0
"""Issue 57: on one node, the best builder's step rate at least GOAL_KERAS x plain Keras's."""
INFORMATIVE = "informative"
"""A goal cell's outcome where the goal does not apply but its figure is shown."""
_GiB = 2 ** 30


# --------------------------------------------------------------------------- the jobs

def _compiled(model, optimizer: str, wrap_optimizer, loss):
    import keras
    chosen = getattr(keras.optimizers, OPTIMIZERS[optimizer].keras_class)(OPTIMIZERS[optimizer].rate)
    model.compile(optimizer=wrap_optimizer(chosen) if wrap_optimizer else chosen, loss=loss)
    return model


class OneTable:
    """One table: ``Input(8 ids) -> Embedding(rows, 64) -> mean -> Dense(256, relu) ->
    Dense(1)``, mean squared error; ids uniform over the table, standard normal targets.

    Only API Keras 2 and 3 share, so Horovod's job (TensorFlow 2.15's Keras 2) builds
    the same model; ``sequential`` and ``wrap_optimizer`` as for
    ``keras_step_time.build_model``.
    """

    name = "one_table"
    title, anchor = TITLE, ANCHOR
    begin, end = BEGIN, END
    unsupported: dict = {}
    step_goals = True  # the issues' step-time goals are set on this model
    goals = (
        "**Goal** (issue 31): with SGD, `PartitionedPS` and `Parallax` step at 10M rows at most "
        "1.5x their step at 100k; the best builder at least 2x Horovod's step rate at 1M and "
        "10M rows; `PartitionedPS`'s peak memory per node at most its share of the table "
        "(with slots) plus 1.5 GB.",
        "**Goal** (issue 57, updates of only the rows a step touched: SGD, Adagrad, FTRL): on "
        f"one node with Adagrad and 10M rows, the best builder at least 3x as fast as `{KERAS}`; "
        "on the cluster with Adagrad and 1M rows, at least 2x Horovod's step rate; "
        "with SGD, Adagrad and FTRL, `PartitionedPS`'s step at 10M rows at most 1.5x its step "
        "at 100k on the cluster (one node: informative).")
    """The docs section's paragraphs on the goals its checks test."""

    def __init__(self, table_rows: int):
        self.tables = [table_rows]

    def build(self, optimizer: str, sequential=None, wrap_optimizer=None):
        import keras
        model = (sequential or keras.Sequential)([
            keras.Input((IDS_PER_EXAMPLE,), dtype="int32"),
            keras.layers.Embedding(self.tables[0], DIM),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(HIDDEN, activation="relu"),
            keras.layers.Dense(1)])
        return _compiled(model, optimizer, wrap_optimizer, "mse")

    def data(self, seed: int, rows: int):
        """``rows`` examples: ids uniform over the table, standard normal targets."""
        import numpy as np
        rng = np.random.RandomState(seed)
        return (rng.randint(0, self.tables[0], size=(rows, IDS_PER_EXAMPLE)).astype(np.int32),
                rng.standard_normal((rows, 1)).astype(np.float32))

    @staticmethod
    def describe(sizes: str) -> str:
        return (f"Keras `fit` of `Input({IDS_PER_EXAMPLE} ids) -> Embedding(rows, {DIM}) -> mean "
                f"-> Dense({HIDDEN}, relu) -> Dense(1)` (mean squared error, ids uniform over the "
                f"table, {ROWS_PER_NODE} rows per node per step), tables of {sizes} of float32")


class Dlrm(OneTable):
    """A DLRM-style ranking model, as recommender users build it in Keras: dense features
    through a bottom MLP; one id per categorical feature, each looked up in its own table
    (``DLRM_SHARES`` of the rows); the pairwise dot products of the bottom MLP's output and
    the looked-up vectors (DLRM's dot interaction), beside that output, through a top MLP to
    one logit; binary cross-entropy against random 0/1 labels. Keras 2 and 3 API only.

    ``MultiWorkerMirroredStrategy`` is not run: Keras 3's ``fit`` fails under it with
    several workers, and the work-around (``keras_step_time._mwms_sequential``) is for a
    ``Sequential`` model."""

    name = "dlrm"
    title, anchor = next(s for s in report.SECTIONS if s[0].endswith("(`embeddings --model dlrm`)"))
    begin, end = "<!-- embeddings-dlrm:begin -->", "<!-- embeddings-dlrm:end -->"
    unsupported = {MWMS: "Keras 3's fit fails under MultiWorkerMirroredStrategy with several "
                         "workers (keras-team/keras#20585); the work-around is for Sequential models"}
    step_goals = False
    goals = ("**Goal:** `PartitionedPS`'s peak memory per node at most its share of the tables "
             "(with slots) plus 1.5 GB; the step times are shown beside the one-table model's "
             "goals, not checked.",)

    def __init__(self, table_rows: int):
        self.tables = [max(1, int(table_rows * share)) for share in DLRM_SHARES]

    def build(self, optimizer: str, sequential=None, wrap_optimizer=None):
        import keras
        dense = keras.Input((DENSE_FEATURES,), name="dense_features")
        ids = [keras.Input((1,), dtype="int32", name=f"ids_{i}") for i in range(len(self.tables))]
        bottom = keras.layers.Dense(HIDDEN, activation="relu")(dense)
        bottom = keras.layers.Dense(DIM, activation="relu")(bottom)
        vectors = [keras.layers.Reshape((1, DIM))(bottom)] + [
            keras.layers.Embedding(rows, DIM, name=f"table_{i}")(feature)
            for i, (rows, feature) in enumerate(zip(self.tables, ids))]
        stacked = keras.layers.Concatenate(axis=1)(vectors)
        top = keras.layers.Concatenate()([bottom, _dot_interaction()(stacked)])
        top = keras.layers.Dense(HIDDEN, activation="relu")(top)
        model = keras.Model([dense, *ids], keras.layers.Dense(1)(top))
        return _compiled(model, optimizer, wrap_optimizer,
                         keras.losses.BinaryCrossentropy(from_logits=True))

    def data(self, seed: int, rows: int):
        """``rows`` examples: standard normal dense features, ids uniform over each table,
        0/1 labels."""
        import numpy as np
        rng = np.random.RandomState(seed)
        x = [rng.standard_normal((rows, DENSE_FEATURES)).astype(np.float32)] + [
            rng.randint(0, size, size=(rows, 1)).astype(np.int32) for size in self.tables]
        return x, rng.randint(0, 2, size=(rows, 1)).astype(np.float32)

    @staticmethod
    def describe(sizes: str) -> str:
        shares = ", ".join(f"1/{round(1 / s)}" if s < 1 else "1" for s in DLRM_SHARES)
        return (f"Keras `fit` of a DLRM-style model: {DENSE_FEATURES} dense features through "
                f"`Dense({HIDDEN}, relu) -> Dense({DIM}, relu)`; {len(DLRM_SHARES)} categorical "
                f"features, one id each, in tables of {shares} of the rows, {DIM} columns; the "
                f"pairwise dot products of the dense output and the {len(DLRM_SHARES)} vectors "
                "beside the dense "
                f"output, then `Dense({HIDDEN}, relu) -> Dense(1)`, binary cross-entropy "
                f"({ROWS_PER_NODE} rows per node per step, ids uniform); rows "
                f"of the largest table: {sizes}")


def _dot_interaction():
    """DLRM's dot interaction: each pair of the stacked vectors' dot product, once."""
    import keras
    import tensorflow as tf

    class DotInteraction(keras.layers.Layer):
        def call(self, stacked):
            count = stacked.shape[1]
            products = tf.reshape(tf.matmul(stacked, stacked, transpose_b=True), [-1, count * count])
            return tf.gather(products, [i * count + j for i in range(count)
                                        for j in range(i + 1, count)], axis=1)

    return DotInteraction()


MODELS = {model.name: model for model in (OneTable, Dlrm)}


def run_job(args) -> None:
    """This process's part of a job (``--_job``), on the model and data of ``args``."""
    chosen = MODELS[args.model](args.table_rows)
    model, data = functools.partial(chosen.build, args.optimizer), chosen.data
    if args._job == "horovod":  # pylint: disable=protected-access
        horovod_peer.job(args.warmup, args.timed, model, data, args.rows_per_replica)
        return
    lazy = OPTIMIZERS[args.optimizer].lazy
    jobs = {"autodist": functools.partial(kst.job_autodist, args.spec, args.builder,
                                          wrap_builder=_lazy_row_updates if lazy else None),
            "mirrored": kst.job_mirrored, "mwms": kst.job_mwms, "keras": job_keras}
    jobs[args._job](args.warmup, args.timed, model, data,  # pylint: disable=protected-access
                    args.rows_per_replica)


def _lazy_row_updates(builder):
    from autodist.strategy import LazyRowUpdates
    return LazyRowUpdates(builder)


def job_keras(warmup: int, timed: int, build, data, rows_per_replica: int) -> None:
    """Plain Keras (``KERAS``): ``model.fit`` in this process on its one CPU device, with no
    AutoDist and no tf.distribute strategy, in batches of the one_node jobs' global batch
    (``rows_per_replica`` x their replicas), on their data (seed 0) and with their initial
    weights, timer and thread limits (arguments as for ``keras_step_time.job_autodist``)."""
    kst.limit_threads()
    kst.time_one_process_fit(KERAS, contextlib.nullcontext(), warmup, timed, build, data,
                             rows_per_replica * kst.ONE_NODE_REPLICAS)


def job_args(kind: str, case, *extra: str) -> list:
    """The script and arguments of a job of ``case`` (the driver's options plus the table's
    rows, the optimizer and the rows per replica)."""
    return [os.path.abspath(__file__), "--_job", kind, *extra,
            "--warmup", str(case.warmup), "--timed", str(case.timed),
            "--model", case.model, "--table-rows", str(case.table_rows),
            "--optimizer", case.optimizer,
            "--rows-per-replica", str(case.rows_per_replica)]


def job_argv(kind: str, case, *extra: str) -> list:
    """``job_args`` run by this Python (``keras_step_time``'s ``job_argv``)."""
    return [sys.executable, *job_args(kind, case, *extra)]


# --------------------------------------------------------------------------- memory

def table_gb(table_rows: int, model=None) -> float:
    """The bytes of ``model``'s tables (default ``OneTable``) at ``table_rows`` rows, GiB."""
    return sum((model or OneTable)(table_rows).tables) * DIM * 4 / _GiB


def available_gb() -> float:
    """The machine's available memory (``MemAvailable``), GiB."""
    with open("/proc/meminfo", encoding="utf-8") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) / 2 ** 20


class MemoryEstimates:
    """Peak memory per process, measured and estimated, per (setting, optimizer, system)."""

    def __init__(self, model=None):
        self.model = model or OneTable
        self.peaks = {}  # key -> {table rows: largest per-process peak seen, GiB}
        self.out_of_memory = {}  # key -> the smallest table rows whose job the watchdog stopped

    def record(self, key: tuple, table_rows: int, row: dict) -> None:
        if row.get("out_of_memory"):
            self.out_of_memory[key] = min(table_rows, self.out_of_memory.get(key, table_rows))
        elif row.get("peak_rss_gb"):
            points = self.peaks.setdefault(key, {})
            points[table_rows] = max(points.get(table_rows, 0.0), max(row["peak_rss_gb"]))

    def per_process_gb(self, key: tuple, table_rows: int, slots: int) -> float:
        """The estimate of the module's docstring; for a table the system already ran
        with, its measured peak."""
        state = table_gb(table_rows, self.model) * (1 + slots)
        a_priori = BASE_GB + GROWTH * state
        points = self.peaks.get(key, {})
        if table_rows in points:
            return points[table_rows]
        smaller = sorted((table_gb(r, self.model), peak) for r, peak in points.items()
                         if r < table_rows)
        size = table_gb(table_rows, self.model)
        if len(smaller) >= 2:
            (t1, p1), (t2, p2) = smaller[-2:]
            return max(p2, p2 + (p2 - p1) / (t2 - t1) * (size - t2))
        if smaller:  # its peak there, and the a-priori growth: 2 x the added table and slots
            (t1, p1), = smaller
            return p1 + GROWTH * (state - t1 * (1 + slots))
        return a_priori

    def too_large(self, key: tuple, table_rows: int):
        """The smaller table at which this system ran out of memory, or None."""
        stopped = self.out_of_memory.get(key)
        return stopped if stopped is not None and stopped <= table_rows else None


def _parents() -> dict:
    """pid -> parent pid of every live process on the machine (zombies left out)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                    state, parent = f.read().rpartition(")")[2].split()[:2]
            except (OSError, ValueError):
                continue
            if state != "Z":
                parents[int(entry)] = int(parent)
    return parents


def descendants() -> list:
    """The ids of every process this one started, and theirs, and so on."""
    parents = _parents()
    found, frontier = [], [os.getpid()]
    while frontier:
        frontier = [pid for pid, parent in parents.items() if parent in frontier]
        found += frontier
    return found


def _rss_gb(pids: list) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm", encoding="utf-8") as f:
                total += int(f.read().split()[1])
        except (OSError, ValueError, IndexError):
            pass
    return total * os.sysconf("SC_PAGE_SIZE") / _GiB


class MemoryWatchdog:
    """While active, samples the memory of this process's descendants and, when the
    machine's available memory falls below ``floor_gb``, kills them all (SIGKILL, by id).

    Attributes:
        stopped_at_gb: the available memory that made it stop the job, or None.
        peak_gb: the largest sum of the descendants' resident memory it sampled.
    """

    def __init__(self, floor_gb: float, interval_s: float = 0.1, sample_every: int = 10):
        self.floor_gb, self.interval_s, self.sample_every = floor_gb, interval_s, sample_every
        self.stopped_at_gb, self.peak_gb = None, 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        polls = 0
        while not self._done.wait(self.interval_s):
            polls += 1
            available = available_gb()  # cheap; the process scan only every sample_every polls
            if polls % self.sample_every == 0 or available < self.floor_gb:
                pids = descendants()
                self.peak_gb = max(self.peak_gb, _rss_gb(pids))
            if available >= self.floor_gb:
                continue
            self.stopped_at_gb = available
            deadline = time.monotonic() + 5.0  # also any process started meanwhile
            while pids and time.monotonic() < deadline:
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.2)
                pids = descendants()
            return


# --------------------------------------------------------------------------- measuring

def _label(table_rows: int) -> str:
    for unit, name in ((1_000_000, "M"), (1_000, "k")):
        if table_rows % unit == 0:
            return f"{table_rows // unit}{name}"
    return str(table_rows)


def _systems(setting: str, args) -> list:
    return list(args.builders) + [p for p in SETTING_PEERS[setting] if p in args.systems]


def measure(setting: str, args, memory: MemoryEstimates) -> dict:
    """Every case of ``setting``: (optimizer, table rows) -> system -> list of job rows."""
    results = {}
    ports = iter(range(MWMS_PORT, MWMS_PORT + 1000))
    with kst.setting_spec(setting, CLUSTER_NAME) as (spec, cluster):
        if cluster is not None and HOROVOD in args.systems:
            import peers
            peers.name_hosts(cluster)  # Horovod's Gloo opens its devices by host name
        for optimizer in args.optimizers:
            for table_rows in args.rows:
                case = argparse.Namespace(**{
                    **vars(args), "table_rows": table_rows, "optimizer": optimizer,
                    "rows_per_replica": ROWS_PER_NODE // REPLICAS_PER_NODE[setting]})
                job = functools.partial(_run_job, spec, cluster, ports, case)
                run = functools.partial(_guarded, setting, case, memory, job)
                label = f"{setting} {_label(table_rows)} rows {optimizer}"
                results[(optimizer, table_rows)] = kst.run_rounds(
                    label, _systems(setting, args), run, args.rounds, rotate=True)
    return results


def _run_job(spec: str, cluster, ports, case, system: str) -> dict:
    """One job of ``system`` on ``case``: on this machine without ``cluster``, else on it."""
    why = MODELS[case.model].unsupported.get(system)
    if why:
        return {"system": system, "skipped": True, "error": f"skipped: not supported ({why})"}
    if system == HOROVOD:
        if case.horovod_error:
            return {"system": system, "error": case.horovod_error}
        return horovod_peer.run(cluster, case.horovod_venv, case, job_args("horovod", case))
    if system == KERAS:
        if cluster is not None:
            return {"system": system, "error": f"{KERAS} runs on one node only"}
        return kst.job_result(system, kst.collect(
            [kst.start_job(job_argv("keras", case), kst.job_env())], case.timeout))
    if cluster is None:
        return kst.run_one_node(system, spec, case, job_argv)
    return kst.run_cluster(system, spec, cluster, case, next(ports), job_argv)


def _guarded(setting: str, case, memory: MemoryEstimates, job, system: str) -> dict:
    """``job(system)`` if its memory fits, under the watchdog; a skipped row otherwise."""
    key = (setting, case.optimizer, system)
    stopped = memory.too_large(key, case.table_rows)
    if stopped is not None:
        return {"system": system, "skipped": True,
                "error": f"skipped: ran out of memory at {_label(stopped)} rows"}
    per_process = memory.per_process_gb(key, case.table_rows, OPTIMIZERS[case.optimizer].slots)
    need, available = per_process * PROCESSES[setting], available_gb()
    if need > available - case.reserve_gb:
        return {"system": system, "skipped": True, "needs_gb": need,
                "error": f"skipped: needs ~{need:.1f} GB ({available:.1f} GB available, "
                         f"{case.reserve_gb:g} GB of it kept free)"}
    with MemoryWatchdog(FLOOR_GB) as watchdog:
        try:
            row = job(system)
        except Exception as err:  # pylint: disable=broad-except
            # One job's surprise in the driver costs its row, not the hours of the other runs.
            traceback.print_exc()
            row = {"system": system, "error": f"driver error: {type(err).__name__}: {err}"}
    if watchdog.stopped_at_gb is not None:
        row = {"system": system, "out_of_memory": True,
               "error": f"stopped: the machine's available memory fell to "
                        f"{watchdog.stopped_at_gb:.1f} GB (the job held ~{watchdog.peak_gb:.1f} GB)"}
    memory.record(key, case.table_rows, row)
    print(f"    memory: estimated {need:.1f} GB, sampled peak {watchdog.peak_gb:.1f} GB; "
          "per process " + " ".join(f"{g:.2f}" for g in row.get("peak_rss_gb", [])), flush=True)
    return row


# --------------------------------------------------------------------------- summarizing

def summarize(setting: str, results: dict) -> dict:
    """(optimizer, table rows) -> system -> its summary: the median step over rounds, the
    peak memory (largest over processes and rounds), the ratio vs the peer, for a builder
    the ratio vs plain Keras (``vs_keras``: Keras's step time over the builder's), errors."""
    out = {}
    for case, systems in results.items():
        rows = {}
        for system, runs in systems.items():
            done = [r for r in runs if "median_s" in r]
            row = {"system": system, "peer": system in PEER_SYSTEMS,
                   "rounds": [r["median_s"] for r in done],
                   "errors": [r["error"] for r in runs if "error" in r]}
            if done:
                row["median_s"] = statistics.median(row["rounds"])
                peaks = [g for r in done for g in r.get("peak_rss_gb", [])]
                row["peak_gb"] = max(peaks) if peaks else None
            rows[system] = row
        peer = rows.get(RATIO_PEER[setting], {})
        plain = rows.get(KERAS, {})
        for system, row in rows.items():
            if "median_s" in row and "median_s" in peer and row is not peer:
                row["vs_peer"] = peer["median_s"] / row["median_s"]
            if "median_s" in row and "median_s" in plain and system not in OTHER_SYSTEMS:
                row["vs_keras"] = plain["median_s"] / row["median_s"]
        out[case] = rows
    return out


def _step(table: dict, optimizer: str, table_rows: int, system: str):
    return table.get((optimizer, table_rows), {}).get(system, {}).get("median_s")


def _short(error: str) -> str:
    """A table cell for a run that did not finish: skipped (and why), stopped, or failed."""
    if error.startswith("skipped"):
        return error.split(" (")[0]
    return "stopped: memory ran low" if error.startswith("stopped:") else "failed"


def _why_missing(table: dict, optimizer: str, table_rows: int, system: str) -> str:
    row = table.get((optimizer, table_rows), {}).get(system)
    if row is None:
        return f"{_label(table_rows)} not run"
    return f"{_label(table_rows)} " + (_short(row["errors"][0]) if row["errors"]
                                       else "not measured")


def _not_run(optimizer: str, args):
    """A goal cell for an optimizer this run left out, or None."""
    return (None, f"not measured: {OPTIMIZERS[optimizer].label} not run") \
        if optimizer not in args.optimizers else None


def _scaling_cell(table: dict, builder: str, optimizer: str, args, informative: bool) -> tuple:
    """``builder``'s step at GOAL_LARGE rows over its step at GOAL_SMALL, as a goal cell;
    an ``informative`` one shows the figure with INFORMATIVE in place of met or missed."""
    small, large = (_step(table, optimizer, r, builder) for r in (GOAL_SMALL, GOAL_LARGE))
    if small is None or large is None:
        missing = _not_run(optimizer, args)
        text = missing[1] if missing else "not measured: " + "; ".join(
            _why_missing(table, optimizer, r, builder)
            for r, t in ((GOAL_SMALL, small), (GOAL_LARGE, large)) if t is None)
        return (INFORMATIVE, text + " (informative)") if informative else (None, text)
    ratio = large / small
    met = ratio <= GOAL_SCALING
    figure = f"{ratio:.2f}x ({small * 1e3:.0f} -> {large * 1e3:.0f} ms): "
    if informative:
        return INFORMATIVE, figure + (f"within {GOAL_SCALING}x" if met
                                      else f"over {GOAL_SCALING}x") + " (informative)"
    return met, figure + ("met" if met else "MISSED")


def _best_builder_cell(table: dict, optimizer: str, table_rows: int, reference: str,
                       goal: float, args) -> tuple:
    """Whether the fastest builder at ``table_rows`` steps at least ``goal`` x as fast as
    ``reference`` (its step time over the builder's), as a goal cell."""
    missing = _not_run(optimizer, args)
    if missing:
        return missing
    other = _step(table, optimizer, table_rows, reference)
    timed = [(s, _step(table, optimizer, table_rows, s)) for s in args.builders]
    timed = [(s, t) for s, t in timed if t is not None]
    if other is None or not timed:
        return None, "not measured: " + (
            _why_missing(table, optimizer, table_rows, reference) if other is None
            else f"no builder ran at {_label(table_rows)}")
    best, time_s = min(timed, key=lambda st: st[1])
    ratio = other / time_s
    met = ratio >= goal
    return met, f"{ratio:.2f}x (`{best}`): " + ("met" if met else "MISSED")


def goal_verdicts(tables: dict, args) -> list:
    """(goal text, {setting: (outcome, cell text)}) for each goal, over the settings run;
    the outcome is True (met), False (missed), None (not measured) or INFORMATIVE (a figure
    where the goal does not apply). The step-time goals are set on the one-table model, the
    memory goal on every model."""
    model = MODELS[args.model]
    return (_step_goals(tables, args) if model.step_goals else []) + _memory_goals(tables, args,
                                                                                  model)


def _step_goals(tables: dict, args) -> list:
    out = []
    for builder, optimizer, informative in SCALING_GOALS:
        cells = {setting: _scaling_cell(table, builder, optimizer, args, setting in informative)
                 for setting, table in tables.items()}
        goal_on = [SHORT[s] for s in SETTINGS if s not in informative]
        where = ("" if not informative else "; informative: the growth is reported" if not goal_on
                 else f"; goal on {', '.join(goal_on)}, "
                      f"{', '.join(SHORT[s] for s in informative)} informative")
        out.append((f"`{builder}` step at {_label(GOAL_LARGE)} rows <= {GOAL_SCALING}x its step "
                    f"at {_label(GOAL_SMALL)} ({OPTIMIZERS[optimizer].label}{where})", cells))
    for optimizer, table_rows in HOROVOD_GOALS:
        cells = {setting: _best_builder_cell(table, optimizer, table_rows, HOROVOD, GOAL_HOROVOD,
                                             args)
                 if HOROVOD in SETTING_PEERS[setting] else (None, "no Horovod here")
                 for setting, table in tables.items()}
        out.append((f"best AutoDist builder >= {GOAL_HOROVOD:.0f}x Horovod at "
                    f"{_label(table_rows)} rows ({OPTIMIZERS[optimizer].label})", cells))
    cells = {setting: _best_builder_cell(table, GOAL_KERAS_OPTIMIZER, GOAL_KERAS_ROWS, KERAS,
                                         GOAL_KERAS, args)
             if KERAS in SETTING_PEERS[setting] else (None, f"no {KERAS} here")
             for setting, table in tables.items()}
    out.append((f"best AutoDist builder >= {GOAL_KERAS:.0f}x `{KERAS}` at "
                f"{_label(GOAL_KERAS_ROWS)} rows ({OPTIMIZERS[GOAL_KERAS_OPTIMIZER].label}, one node)",
                cells))
    return out


def _memory_goals(tables: dict, args, model) -> list:
    out = []
    for optimizer in args.optimizers:
        slots = OPTIMIZERS[optimizer].slots
        cells = {}
        for setting, table in tables.items():
            checked, worst = 0, None
            for (opt, table_rows), rows in table.items():
                row = rows.get("PartitionedPS", {})
                if opt != optimizer or row.get("peak_gb") is None:
                    continue
                share = table_gb(table_rows, model) * (1 + slots) / PROCESSES[setting]
                allowed = share + GOAL_RSS_EXTRA_GB
                checked += 1
                if worst is None or row["peak_gb"] - allowed > worst[0] - worst[1]:
                    worst = (row["peak_gb"], allowed, table_rows)
            if not checked:
                cells[setting] = (None, "not measured")
                continue
            peak, allowed, table_rows = worst
            met = peak <= allowed
            cells[setting] = (met, f"{'closest' if met else 'worst'} at {_label(table_rows)}: "
                                   f"{peak:.2f} of {allowed:.2f} GB ({checked} tables): "
                                   + ("met" if met else "MISSED"))
        out.append((f"`PartitionedPS` peak memory per node <= its share of the table "
                    f"{'and slots ' if slots else ''}+ {GOAL_RSS_EXTRA_GB} GB "
                    f"({OPTIMIZERS[optimizer].label})", cells))
    return out


# --------------------------------------------------------------------------- reporting

def _cells(row: dict, vs_keras: bool) -> list:
    """Step, peak memory, vs peer and, with ``vs_keras``, vs plain Keras; a row that did not
    run says why in its step cell (the whole message is listed below the tables)."""
    blank = [""] * (3 if vs_keras else 2)
    if row is None:
        return ["not run", *blank]
    if "median_s" not in row:
        return [_short(row["errors"][0]) if row["errors"] else "not run", *blank]
    step = f"{row['median_s'] * 1e3:.1f}" + (f" ({len(row['errors'])} failed)"
                                               if row["errors"] else "")
    return [step, f"{row['peak_gb']:.2f}" if row.get("peak_gb") is not None else "-",
            f"{row['vs_peer']:.2f}x" if "vs_peer" in row else ""] + (
        [f"{row['vs_keras']:.2f}x" if "vs_keras" in row else ""] if vs_keras else [])


def _table_lines(setting: str, optimizer: str, table: dict, args, markdown: bool) -> list:
    sizes = [r for r in args.rows if (optimizer, r) in table]
    systems = _systems(setting, args)
    peer = RATIO_PEER[setting]
    vs_keras = KERAS in systems
    header = ["system"] + [c for r in sizes for c in (
        f"{_label(r)}: step ms", "peak RSS GB", f"vs {peer}", *(["vs Keras"] if vs_keras else []))]
    body = []
    for system in systems:
        tag = " (peer)" if system in PEER_SYSTEMS else " (baseline)" if system == KERAS else ""
        name = f"`{system}`{tag}" if markdown else system
        body.append([name] + [c for r in sizes
                              for c in _cells(table[(optimizer, r)].get(system), vs_keras)])
    if markdown:
        return (["| " + " | ".join(header) + " |", "|---|" + "--:|" * (len(header) - 1)]
                + ["| " + " | ".join(line) + " |" for line in body])
    widths = [max(len(line[i]) for line in [header] + body) for i in range(len(header))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                      for i, (c, w) in enumerate(zip(line, widths))) for line in [header] + body]


def _title(setting: str, optimizer: str) -> str:
    chosen = OPTIMIZERS[optimizer]
    where = kst.TITLES[setting].replace(", 1 CPU replica each", ", 1 CPU replica per node")
    return (f"{where}, {chosen.keras_class}({chosen.rate})"
            + (" under `LazyRowUpdates` (the other systems: exact)" if chosen.lazy else ""))


def _problems(tables: dict) -> list:
    """One line per system and case that did not run every round: why."""
    out = []
    for setting, table in tables.items():
        for (optimizer, table_rows), rows in table.items():
            for system, row in rows.items():
                if row["errors"]:
                    out.append(f"{SHORT[setting]}, {_label(table_rows)} rows, {optimizer}, "
                               f"`{system}`: {row['errors'][0][:300]}")
    return out


def _findings(tables: dict, args) -> list:
    """Per setting and optimizer: the fastest system at the largest table every system of
    the table ran with, and the largest table each system ran with."""
    out = []
    for setting, table in tables.items():
        for optimizer in args.optimizers:
            ran = {s: [r for r in args.rows if "median_s" in table.get((optimizer, r), {}).get(
                s, {})] for s in _systems(setting, args)}
            ran = {s: sizes for s, sizes in ran.items() if sizes}
            if not ran:
                continue
            common = [r for r in args.rows if all(r in sizes for sizes in ran.values())]
            text = f"{SHORT[setting]}, {OPTIMIZERS[optimizer].label}: "
            if common:
                rows = table[(optimizer, common[-1])]
                fastest = min(ran, key=lambda s: rows[s]["median_s"])
                leanest = min(ran, key=lambda s: rows[s]["peak_gb"] or float("inf"))
                text += (f"at {_label(common[-1])} rows `{fastest}` is fastest "
                         f"({rows[fastest]['median_s'] * 1e3:.0f} ms), `{leanest}` needs the "
                         f"least memory ({rows[leanest]['peak_gb']:.2f} GB per process)")
            short = [f"`{s}` up to {_label(sizes[-1])}" for s, sizes in ran.items()
                     if sizes[-1] != args.rows[-1]]
            if common or short:
                out.append(text + ("; " if common and short else "") +
                           ("ran only " + ", ".join(short) if short else "") + ".")
    return out


def _bytes(count: float) -> str:
    """``25.6 MB``, ``256 MB``, ``2.56 GB``: three significant digits."""
    return f"{count / 1e9:.3g} GB" if count >= 1e9 else f"{count / 1e6:.3g} MB"


def format_section(tables: dict, verdicts: list, args, command: str, info: dict,
                   start_load: str, elapsed: float, horovod_versions: str) -> str:
    outcomes = [m for _, cells in verdicts for m, _ in cells.values() if m != INFORMATIVE]
    result = (f"{outcomes.count(True)} of the {len(outcomes)} checks (goal x setting) **met**, "
              f"{outcomes.count(False)} **missed**, {outcomes.count(None)} not measured "
              "(informative cells left out)")
    settings = list(tables)
    model = MODELS[args.model]
    in_all = " in all" if len(model(1).tables) > 1 else ""
    sizes = ", ".join(f"{_label(r)} ({_bytes(table_gb(r, model) * _GiB)}{in_all})"
                      for r in args.rows)
    goals = [line for text in model.goals for line in (text, "")]
    lines = [
        model.begin, f"## {model.title}", "",
        f"**Measures:** {model.describe(sizes)}.", "",
        "Under AutoDist's builders, its peers and plain Keras: median step over interleaved "
        "rounds, each run a fresh job, and each run's largest peak resident memory over its "
        "processes (largest over rounds).", "",
        *goals, f"**Result:** {result}.", "",
        "| goal | " + " | ".join(SHORT[s] for s in settings) + " |",
        "|---|" + "--:|" * len(settings),
        *["| " + goal + " | " + " | ".join(cells[s][1] for s in settings) + " |"
          for goal, cells in verdicts], "",
        *[f"- {f}" for f in _findings(tables, args)], "",
        f"Measured {info['date']} on {info['cores']} cores ({info['cpu']})"
        + (", shared by the cluster's nodes" if "cluster" in tables else "") +
        f"; AutoDist and tf.distribute on TensorFlow {info['tf']} with Keras "
        f"{kst.keras_version()}, " + (f"Horovod on {horovod_versions}" if horovod_versions
                                      else "Horovod not run") +
        f"; Python {info['python']}; median "
        f"of {args.rounds} rounds, each job {args.warmup} warm-up + {args.timed} timed batches, "
        "1 intra-op / 2 inter-op threads per process; 1-minute load average "
        f"{start_load} at the start, {info['load']} at the end; the run took "
        f"{elapsed / 60:.0f} min.", "",
        "Memory: a run is skipped unless its processes' estimated peaks fit in the memory "
        f"available before it, less {args.reserve_gb:g} GB. Per process, with S the table "
        f"with its slots: {BASE_GB:g} GB + {GROWTH:g} x S until the system has run with a "
        f"smaller table; then its measured peak there plus {GROWTH:g} x the S it adds; after two "
        "smaller tables, the line through those two. A job is stopped if the "
        f"machine's available memory falls below {FLOOR_GB:g} GB.", "",
        "Command (root, iproute2; the first run also builds Horovod's venv, about 5 min): "
        f"`{command}`", "",
        "Step in ms; peak RSS in GB, the largest of the run's processes; *vs peer* = the "
        "peer's step time / the system's (above 1: faster than the peer)."
        + (f" `{kst.AUTO}`: its pick by the simulator alone (`trials=0`), made in each job; "
           "without a `memory` in the spec nothing stops it from picking proxies of the table "
           "(a copy per replica)." if any(kst.parse_builder(b)[0] == kst.AUTO
                                         for b in args.builders) else ""), ""]
    if any(KERAS in _systems(s, args) for s in settings):
        lines += [f"`{KERAS}` (baseline, one node only): `model.fit` on one CPU device, no "
                  f"AutoDist and no tf.distribute, in batches of {ROWS_PER_NODE} rows (the one-"
                  "node jobs' global batch), with the same data, timer and threads. *vs Keras* "
                  "= its step time / the builder's (above 1: AutoDist is faster).", ""]
    for setting, table in tables.items():
        for optimizer in args.optimizers:
            if any(opt == optimizer for opt, _ in table):
                lines += [f"**{_title(setting, optimizer)}**", "",
                          *_table_lines(setting, optimizer, table, args, True), ""]
    problems = _problems(tables)
    if problems:
        lines += ["Runs that failed or were skipped:", "", *[f"- {p}" for p in problems], ""]
    lines += [f"How Horovod and `MultiWorkerMirroredStrategy` run: [notes]({NOTES}).", model.end]
    return "\n".join(lines)


# --------------------------------------------------------------------------- main

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS),
                        help="which settings to measure (default: both)")
    parser.add_argument("--rows", nargs="+", type=int, default=list(DEFAULT_ROWS),
                        help="table sizes, in rows of 64 floats (default: 100000 1000000 "
                             "10000000)")
    parser.add_argument("--model", choices=tuple(MODELS), default=OneTable.name,
                        help="one_table: one table, its ids averaged; dlrm: a DLRM-style model "
                             "of 4 tables (--rows rows, 1/4, 1/16, 1/64 of them), dense "
                             "features and a dot interaction; each writes its own section "
                             f"(default: {OneTable.name})")
    parser.add_argument("--optimizers", nargs="+", choices=tuple(OPTIMIZERS),
                        default=list(OPTIMIZERS),
                        help="Keras optimizers: " + ", ".join(
                            f"{o} = {c.keras_class}({c.rate})"
                            + (f" with {c.slots} slot{'s' * (c.slots > 1)}" if c.slots else "")
                            + (" under LazyRowUpdates" if c.lazy else "")
                            for o, c in OPTIMIZERS.items())
                        + f" (default: {' '.join(OPTIMIZERS)})")
    parser.add_argument("--builders", nargs="*", default=list(DEFAULT_BUILDERS),
                        help=f"AutoDist builders (default: {' '.join(DEFAULT_BUILDERS)})")
    parser.add_argument("--systems", nargs="*", choices=OTHER_SYSTEMS,
                        default=list(OTHER_SYSTEMS),
                        help=f"peers and the plain Keras baseline, each run where it applies: "
                             f"MirroredStrategy and '{KERAS}' (model.fit on one device, no "
                             "AutoDist, no strategy) on one node, Horovod and "
                             "MultiWorkerMirroredStrategy on the cluster (default: all)")
    kst.add_job_args(parser)
    parser.set_defaults(timeout=900.0)
    parser.add_argument("--reserve-gb", type=float, default=RESERVE_GB,
                        help="memory left free when deciding whether a run fits (default: "
                             f"{RESERVE_GB:g})")
    parser.add_argument("--horovod-venv", default=horovod_peer.DEFAULT_VENV,
                        help=f"Horovod's venv, built when it does not import Horovod "
                             f"(default: {horovod_peer.DEFAULT_VENV})")
    parser.add_argument("--out", default=os.path.join(REPO, "docs", "benchmarks.md"),
                        help="markdown file whose embeddings section is rewritten")
    parser.add_argument("--no-write", action="store_true", help="only print the tables")
    parser.add_argument("--_job", choices=("autodist", "mirrored", "mwms", "horovod", "keras"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--builder", help=argparse.SUPPRESS)
    parser.add_argument("--table-rows", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--optimizer", choices=tuple(OPTIMIZERS), help=argparse.SUPPRESS)
    parser.add_argument("--rows-per-replica", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args._job:  # pylint: disable=protected-access
        run_job(args)
        return 0
    for builder in args.builders:
        try:
            kst.parse_builder(builder)
        except ValueError as err:
            parser.error(str(err))
    kst.check_job_args(parser, args)
    if any(r < 1 for r in args.rows):
        parser.error("--rows must be positive.")
    args.settings = [s for s in SETTINGS if s in args.settings]
    args.rows = sorted(set(args.rows))  # smallest first: the memory estimates learn from them
    args.optimizers = [o for o in OPTIMIZERS if o in args.optimizers]
    if not any(_systems(s, args) for s in args.settings):
        parser.error("nothing to run: give at least one of --builders and --systems.")
    return horovod_peer.run_benchmark(
        args, HOROVOD in args.systems and "cluster" in args.settings, lambda: _run(parser, args))


def _run(parser, args) -> int:
    runs_horovod = HOROVOD in args.systems and "cluster" in args.settings
    horovod_versions = (horovod_peer.versions(args.horovod_venv)
                        if runs_horovod and not args.horovod_error else "")
    model = MODELS[args.model]
    print(f"model {model.name}; tables {', '.join(f'{_label(r)} rows ({table_gb(r, model):.2f} GiB)' for r in args.rows)}; "
          f"optimizers {args.optimizers}; builders {args.builders}; others {args.systems}; "
          f"{available_gb():.1f} GiB available; Horovod: {horovod_versions or 'not run'}",
          flush=True)
    start, start_load = time.perf_counter(), report.machine_info()["load"]
    memory, tables = MemoryEstimates(MODELS[args.model]), {}
    for setting in args.settings:
        tables[setting] = summarize(setting, measure(setting, args, memory))
    elapsed = time.perf_counter() - start
    info = report.machine_info()
    for setting, table in tables.items():
        for optimizer in args.optimizers:
            print(f"\n{_title(setting, optimizer)}; median of {args.rounds} rounds; step ms; "
                  f"peak RSS GB (largest process); vs {RATIO_PEER[setting]} = its time / time"
                  + (f"; vs Keras = {KERAS}'s time / the builder's"
                     if KERAS in _systems(setting, args) else ""))
            print("\n".join(_table_lines(setting, optimizer, table, args, False)))
    verdicts = goal_verdicts(tables, args)
    print("\nGoals:")
    for goal, cells in verdicts:
        print(f"  {goal.replace('`', '')}: " +
              "; ".join(f"{SHORT[s]} {text}" for s, (_, text) in cells.items()))
    for line in _findings(tables, args) + _problems(tables):
        print("- " + line.replace("`", ""))
    print(f"\nload average {start_load} at the start, {info['load']} at the end; "
          f"run took {elapsed:.0f} s")
    if not args.no_write:
        command = report.command_line("benchmarks/embeddings.py", parser, args,
                                      skip=("out", "no_write", "horovod_venv"))
        model = MODELS[args.model]
        report.write_section(args.out, format_section(tables, verdicts, args, command, info,
                                                      start_load, elapsed, horovod_versions),
                             model.begin, model.end)
        report.add_contents_entry(args.out, model.title, model.anchor)
        print(f"wrote the section {model.title!r} of {args.out}")
    return 1 if any(m is False for _, cells in verdicts for m, _ in cells.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
