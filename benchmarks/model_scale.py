"""AutoDist's start-up time and memory as the model's bytes grow, against one device.

For every size, a model ``Input(W) -> Dense(W) -> Dense(1)`` whose weights take
about that many bytes trains on 8 batches of 32 rows (mean squared error), on
one device and through AutoDist, each run in a fresh process, the runs
interleaved per size. Three ways of writing it, each with its single-device
reference first:

* ``fit``: Keras 3 ``model.fit`` of the arrays batched by ``tf.data`` without
  autotuning (``_batches``) against AutoDist on one node with two CPU
  replicas (``configs/local_2cpu.yml``) under ``--builders``; with one replica
  (AutoDist's own memory, without a second replica's gradient); and, up to
  ``--two-nodes-up-to-mb``, on a two-node emulated cluster (one replica each,
  root and iproute2 needed), every node's process measured;
* a custom loop: ``tf.function`` against ``ad.function`` under ``--builders``,
  copying the weights back after every call (the default), and on request
  (``copy_back="on_request"``, one ``copy_to_model()`` after the loop);
* ``tf.compat.v1``: a graph and a plain session against
  ``ad.create_distributed_session()``.

Per run: the first step (from the call to ``fit``, or from building the session,
to the end of the first batch: for AutoDist tracing, lifting, building,
compiling, rewriting, initializing); the whole run; the median of steps 2-8;
the peak resident memory (``VmHWM``, taken before the weights are saved);
and the largest difference of any trained weight from the reference's.

The goals (issue 30), checked at every size. On one node with two replicas:
the first step at most the reference's plus 10 s; the whole ``fit`` at most
2x plain Keras's from 256 MB on; ``ad.function``'s later calls within 1.2x of
``fit``'s later steps. On every run and every node: peak memory at most the
reference's plus one copy of the training state (weights and slots) plus
512 MB, and the trained weights equal to the reference's. The two-node first
step is shown beside the goals (the issue asks equal weights and memory of it).

Usage:
    python benchmarks/model_scale.py          # 16 MB, 256 MB, 1 GB, 3 GB; writes docs
    python benchmarks/model_scale.py --sizes-mb 16 --no-write
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

import report

report.use_job_environment()

BEGIN = "<!-- model_scale:begin -->"
END = "<!-- model_scale:end -->"
ROWS, BATCHES = 32, 8
# Copies of the weights in an optimizer's training state: the weights and their slots.
STATE_COPIES = {"sgd": 1, "adagrad": 2, "rmsprop": 2, "adam": 3, "adamw": 3}
MEMORY_ALLOWANCE_GB = 0.5  # beside one copy of the training state
FIRST_STEP_ALLOWANCE_S = 10.0
FIT_RATIO, FIT_RATIO_FROM_MB = 2.0, 256
LOOP_RATIO, LOOP_RATIO_FROM_MB = 1.2, 1024
TOLERANCE = 1e-5
SEED = 0
CLUSTER_NAME = "adscale"
CLUSTER_BANDWIDTH = "10gbit"
_RESULT_TAG = "MODEL_SCALE_RESULT "
_GiB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Case:
    """One way of training the model: a single-device reference (no ``builder``) or
    AutoDist with ``replicas`` CPU replicas per node on ``nodes`` nodes."""

    table: str  # "fit", "loop" or "graph"
    system: str
    builder: Optional[str] = None
    replicas: int = 2
    nodes: int = 1
    copy_back: str = "every_call"

    @property
    def key(self) -> str:
        return f"{self.table}:{self.system}"

    @property
    def judged_for_speed(self) -> bool:
        """Whether the time goals apply: AutoDist on the benchmark's node, two replicas."""
        return self.builder is not None and self.replicas == 2 and self.nodes == 1


def cases(builders: list) -> list:
    """Every case, each table's reference first."""
    first, rest = builders[0], builders
    return ([Case("fit", "keras")]
            + [Case("fit", b, b) for b in rest]
            + [Case("fit", f"{first}, 1 replica", first, replicas=1),
               Case("fit", f"{first}, 2 nodes", first, replicas=1, nodes=2),
               Case("loop", "tf.function")]
            + [Case("loop", f"ad.function {b}", b) for b in rest]
            + [Case("loop", f"ad.function {first}, on request", first, copy_back="on_request"),
               Case("graph", "tf.compat.v1"), Case("graph", f"AutoDist {first}", first)])


def width_for(megabytes: float) -> int:
    """The width W whose W x W float32 kernel takes about ``megabytes``."""
    return int(math.sqrt(megabytes * 2 ** 20 / 4))


# --------------------------------------------------------------------------- one run

def _autodist(case: Case, spec: Optional[str]):
    from autodist import AutoDist
    from autodist.strategy import get_builder
    if spec is None:
        spec = (os.path.join(report.REPO, "configs", "local_2cpu.yml") if case.replicas == 2
                else report.one_replica_spec())
    return AutoDist(spec, get_builder(case.builder))


def _data(width: int) -> tuple:
    import numpy as np
    rng = np.random.default_rng(0)
    # Inputs of norm about 1 keep SGD stable at every width (an input of W unit
    # entries makes the output layer's step grow with W and training diverge, which
    # would amplify rounding into large differences of the weights).
    return ((rng.normal(size=(ROWS * BATCHES, width)) / math.sqrt(width)).astype("float32"),
            rng.normal(size=(ROWS * BATCHES, 1)).astype("float32"))


def _node_rows(nodes: int, node: int):
    """The rows of the global batches node ``node`` trains on: its share of each."""
    import numpy as np
    share = ROWS // nodes
    return np.concatenate([np.arange(b * ROWS + node * share, b * ROWS + (node + 1) * share)
                           for b in range(BATCHES)])


def _peak_rss_gb() -> float:
    """This process's peak resident memory (``VmHWM``: unlike ``ru_maxrss``, not
    inherited from the process that started it)."""
    with open("/proc/self/status", encoding="utf-8") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 2 ** 20


def _save(values, prefix: Optional[str]) -> None:
    """Writes each value (``values``: callables, one at a time) to ``{prefix}.{i}.npy``."""
    import numpy as np
    if prefix:
        for index, value in enumerate(values):
            np.save(f"{prefix}.{index}.npy", value())


def _batches(x, y, rows: int):
    """The arrays as a ``tf.data`` pipeline without autotuning, for both systems alike.

    Given the arrays, Keras builds a pipeline that autotunes, and tf.data's tuning
    thread, whose period doubles from 10 ms, stalled a step at about 5 s and held
    ``fit``'s return until its next period (about 10 s from the start), whatever
    trained (docs/notes/model_scale.md): the ``fit`` totals measured when a run
    crossed those marks, not the systems.
    """
    import tensorflow as tf
    batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(rows)
    options = tf.data.Options()
    options.autotune.enabled = False
    return batches.with_options(options)


def _keras_model(width: int, optimizer: str):
    import keras
    keras.utils.set_random_seed(SEED)
    model = keras.Sequential([keras.Input((width,)), keras.layers.Dense(width),
                              keras.layers.Dense(1)])
    return model, keras.optimizers.get(optimizer)


def run_fit(case: Case, width: int, optimizer: str, spec: Optional[str],
            save: Optional[str]) -> dict:
    import keras

    class StepTimes(keras.callbacks.Callback):
        autodist_reads_weights = False  # a timer: AutoDist need not copy weights per batch

        def __init__(self, started: float):
            super().__init__()
            self.ends, self._started = [], started

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter() - self._started)

    x, y = _data(width)
    begun = time.perf_counter()
    ad = _autodist(case, spec) if case.builder else None
    if case.nodes > 1:
        rows = _node_rows(case.nodes, ad.node_index)
        x, y = x[rows], y[rows]
    with ad.scope() if ad else contextlib.nullcontext():
        model, opt = _keras_model(width, optimizer)
        model.compile(optimizer=opt, loss="mse")
    started = time.perf_counter()
    times = StepTimes(started)
    model.fit(_batches(x, y, ROWS // case.nodes), epochs=1, verbose=0, callbacks=[times])
    figures = {"build": started - begun, "first_step": times.ends[0],
               "run": time.perf_counter() - started,
               "later": statistics.median(b - a for a, b in zip(times.ends, times.ends[1:])),
               "peak_rss_gb": _peak_rss_gb(), "node": ad.node_index if ad else 0}
    if ad is None or ad.is_chief:
        _save([v.numpy for v in model.weights], save)
    return figures


def run_loop(case: Case, width: int, optimizer: str, spec: Optional[str],
             save: Optional[str]) -> dict:
    import tensorflow as tf

    begun = time.perf_counter()
    ad = _autodist(case, spec) if case.builder else None
    with ad.scope() if ad else contextlib.nullcontext():
        model, opt = _keras_model(width, optimizer)
    built = time.perf_counter() - begun

    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    step = ad.function(train_step, copy_back=case.copy_back) if ad else tf.function(train_step)
    x, y = _data(width)
    calls, started = [], time.perf_counter()
    for batch in range(BATCHES):
        begun = time.perf_counter()
        float(step(x[batch * ROWS:(batch + 1) * ROWS], y[batch * ROWS:(batch + 1) * ROWS]))
        calls.append(time.perf_counter() - begun)
    begun = time.perf_counter()
    if ad:
        step.copy_to_model()
    copy = time.perf_counter() - begun
    figures = {"build": built, "first_step": calls[0], "later": statistics.median(calls[1:]),
               "copy": copy,
               "run": time.perf_counter() - started, "peak_rss_gb": _peak_rss_gb()}
    _save([v.numpy for v in model.weights], save)
    return figures


_GRAPH_OPTIMIZERS = {"sgd": ("GradientDescentOptimizer", 0.01), "adam": ("AdamOptimizer", 0.001)}


def run_graph(case: Case, width: int, optimizer: str, spec: Optional[str],
              save: Optional[str]) -> dict:
    """The model as a ``tf.compat.v1`` user writes it: placeholders, ``get_variable``
    with an initializer (no weight values in the graph), an optimizer's ``minimize``."""
    import tensorflow as tf
    tf1 = tf.compat.v1

    x_all, y_all = _data(width)
    begun = time.perf_counter()
    ad = _autodist(case, spec) if case.builder else None
    with tf.Graph().as_default(), ad.scope() if ad else contextlib.nullcontext():
        tf1.set_random_seed(SEED)
        x = tf1.placeholder(tf.float32, [None, width])
        y = tf1.placeholder(tf.float32, [None, 1])
        hidden = x @ tf1.get_variable("dense/kernel", [width, width],
                                      initializer=tf1.glorot_uniform_initializer())
        hidden += tf1.get_variable("dense/bias", [width], initializer=tf1.zeros_initializer())
        out = hidden @ tf1.get_variable("out/kernel", [width, 1],
                                        initializer=tf1.glorot_uniform_initializer())
        out += tf1.get_variable("out/bias", [1], initializer=tf1.zeros_initializer())
        loss = tf.reduce_mean(tf.square(out - y))
        name, rate = _GRAPH_OPTIMIZERS[optimizer]
        train_op = getattr(tf1.train, name)(rate).minimize(loss)
        variables = tf1.trainable_variables()
        started = time.perf_counter()
        if ad:
            session = ad.create_distributed_session()
        else:
            session = tf1.Session()
            session.run(tf1.global_variables_initializer())
        calls = []
        for batch in range(BATCHES):
            rows = slice(batch * ROWS, (batch + 1) * ROWS)
            session.run(train_op, {x: x_all[rows], y: y_all[rows]})
            calls.append(time.perf_counter() - started - sum(calls))
        figures = {"build": started - begun, "first_step": calls[0],
                   "later": statistics.median(calls[1:]),
                   "run": time.perf_counter() - started, "peak_rss_gb": _peak_rss_gb()}
        _save([lambda v=v: session.run(v) for v in variables], save)
    return figures


RUNNERS = {"fit": run_fit, "loop": run_loop, "graph": run_graph}


# --------------------------------------------------------------------------- the driver

def _subprocess_results(argv: list, timeout: float) -> list:
    """The result lines every process of a run printed, or one error."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              start_new_session=True)
    except subprocess.TimeoutExpired:
        return [{"error": f"timed out after {timeout:.0f} s"}]
    results = [json.loads(line[len(_RESULT_TAG):]) for line in done.stdout.splitlines()
               if line.startswith(_RESULT_TAG)]
    if done.returncode == 0 and results:
        return results
    lines = [line for line in done.stderr.splitlines() if line.strip()
             and not line.startswith(("E0000", "I0000", "W0000"))]
    return [{"error": f"exit code {done.returncode}: {(lines or ['no output'])[-1][:300]}"}]


def run(case: Case, width: int, optimizer: str, save: str, timeout: float) -> dict:
    """One case in fresh processes (on an emulated cluster for several nodes); its row."""
    command = [sys.executable, os.path.abspath(__file__), "--case",
               json.dumps(dataclasses.asdict(case)), str(width), optimizer, save]
    if case.nodes == 1:
        results = _subprocess_results(command, timeout)
    else:
        results = _on_emulated_cluster(case, command, timeout)
    if "error" in results[0] or "skipped" in results[0]:
        return results[0]
    results.sort(key=lambda r: r.get("node", 0))
    row = dict(results[0])
    row["node_peaks_gb"] = [r["peak_rss_gb"] for r in results]
    row["peak_rss_gb"] = max(row["node_peaks_gb"])
    return row


def _on_emulated_cluster(case: Case, command: list, timeout: float) -> list:
    if os.geteuid() != 0 or not shutil.which("ip"):
        return [{"skipped": "an emulated cluster needs root and iproute2"}]
    import yaml
    from autodist.cluster import emulate
    emulate.down(CLUSTER_NAME)  # one left behind by an interrupted run
    with emulate.emulated_cluster(case.nodes, CLUSTER_BANDWIDTH, name=CLUSTER_NAME,
                                  cpus_per_node=[case.replicas] * case.nodes) as cluster:
        spec = os.path.join(os.path.dirname(command[-1]), f"{CLUSTER_NAME}.yml")
        with open(spec, "w", encoding="utf-8") as f:
            yaml.safe_dump(emulate.spec_dict(cluster), f)
        return _subprocess_results(cluster.hosts[0].launch_prefix + command + ["--spec", spec],
                                   timeout)


def max_abs_diff(prefix: str, reference: str) -> Optional[float]:
    """The largest difference between the weights saved under two prefixes, read in
    pieces from memory-mapped files; None when a file is missing or shapes differ."""
    import numpy as np
    files = sorted(glob.glob(f"{glob.escape(reference)}.*.npy"))
    if not files:
        return None
    worst = 0.0
    for index in range(len(files)):
        want = np.load(f"{reference}.{index}.npy", mmap_mode="r")
        try:
            got = np.load(f"{prefix}.{index}.npy", mmap_mode="r")
        except FileNotFoundError:
            return None
        if got.shape != want.shape:
            return None
        step = max(1, (64 << 20) // max(1, want[:1].nbytes))
        for start in range(0, max(1, len(want)), step):
            piece = np.abs(np.asarray(got[start:start + step]) - want[start:start + step])
            worst = max(worst, float(piece.max(initial=0.0)))
    return worst


def _remove(prefix: str) -> None:
    for path in glob.glob(f"{glob.escape(prefix)}.*.npy"):
        os.remove(path)


def measure(sizes: list, builders: list, optimizer: str, two_nodes_up_to: float,
            timeout: float, directory: str) -> list:
    """Every case at every size, each AutoDist run's weights compared with its
    table's reference (the two-node one with ``fit``'s)."""
    rows = []
    for megabytes in sizes:
        width = width_for(megabytes)
        references = {}
        for case in cases(builders):
            row = {"megabytes": megabytes, "width": width, "optimizer": optimizer,
                   "case": case}
            if case.nodes > 1 and megabytes > two_nodes_up_to:
                row["skipped"] = f"above --two-nodes-up-to-mb {two_nodes_up_to:g}"
            else:
                save = os.path.join(directory, f"{megabytes:g}.{case.key.replace(' ', '_')}")
                row.update(run(case, width, optimizer, save, timeout))
                if case.builder is None:
                    references[case.table] = save
                elif "error" not in row and "skipped" not in row:
                    row["max_abs_diff"] = max_abs_diff(save, references[case.table])
                    _remove(save)
            print(json.dumps({k: v for k, v in row.items() if k != "case"}
                             | {"case": case.key}), flush=True)
            rows.append(row)
        for prefix in references.values():
            _remove(prefix)
    return rows


# --------------------------------------------------------------------------- the report

def state_gb(row: dict) -> float:
    return row["width"] ** 2 * 4 / _GiB * STATE_COPIES.get(row["optimizer"].lower(), 1)


def _reference(rows: list, row: dict) -> dict:
    return next(r for r in rows if r["megabytes"] == row["megabytes"]
                and r["case"].table == row["case"].table and r["case"].builder is None)


def _ok(row: dict) -> bool:
    return "error" not in row and "skipped" not in row


def memory_bound_gb(rows: list, row: dict) -> float:
    return _reference(rows, row)["peak_rss_gb"] + state_gb(row) + MEMORY_ALLOWANCE_GB


def _cell(row: dict, key: str, fmt: str) -> str:
    if "error" in row:
        return "failed"
    if "skipped" in row:
        return "skipped"
    value = row.get(key)
    return "-" if value is None else fmt.format(value)


COLUMNS = {
    "fit": (("build", "build", "{:.1f} s"), ("first step", "first_step", "{:.1f} s"),
            ("fit", "run", "{:.1f} s"),
            ("later steps", "later", "{:.2f} s"), ("peak RSS", "peak_rss_gb", "{:.2f} GB"),
            ("max abs diff", "max_abs_diff", "{:.1e}")),
    "loop": (("build", "build", "{:.1f} s"), ("first call", "first_step", "{:.1f} s"),
             ("later calls", "later", "{:.2f} s"),
             ("copy_to_model", "copy", "{:.2f} s"), ("loop", "run", "{:.1f} s"),
             ("peak RSS", "peak_rss_gb", "{:.2f} GB"), ("max abs diff", "max_abs_diff", "{:.1e}")),
    "graph": (("build", "build", "{:.1f} s"), ("first step", "first_step", "{:.1f} s"),
              ("8 steps", "run", "{:.1f} s"),
              ("later steps", "later", "{:.2f} s"), ("peak RSS", "peak_rss_gb", "{:.2f} GB"),
              ("max abs diff", "max_abs_diff", "{:.1e}")),
}


def table(rows: list, kind: str) -> str:
    """The runs of one table as Markdown; a two-node run shows each node's peak."""
    columns = COLUMNS[kind]
    lines = ["| weights | system | " + " | ".join(c[0] for c in columns) + " | memory bound |",
             "|---|---|" + "--:|" * (len(columns) + 1)]
    for row in (r for r in rows if r["case"].table == kind):
        cells = [f"{row['megabytes']:g} MB", f"`{row['case'].system}`"]
        cells += [_cell(row, key, fmt) for _, key, fmt in columns]
        if _ok(row) and len(row.get("node_peaks_gb", [])) > 1:
            peak = 2 + [key for _, key, _ in columns].index("peak_rss_gb")
            cells[peak] = " / ".join(f"{g:.2f}" for g in row["node_peaks_gb"]) + " GB"
        bound = row["case"].builder and _ok(row) and _ok(_reference(rows, row))
        cells.append(f"{memory_bound_gb(rows, row):.2f} GB" if bound else "-")
        lines.append("| " + " | ".join(cells) + " |")
    problems = [f"- {row['megabytes']:g} MB, `{row['case'].system}`: "
                + row.get("error", row.get("skipped", "")) for row in rows
                if row["case"].table == kind and not _ok(row)]
    return "\n".join(lines + ([""] + problems if problems else []))


def _start_up(row: dict) -> float:
    """From building the model to the end of its first step: Keras computes the initial
    weights while it builds, AutoDist in its first step."""
    return row["build"] + row["first_step"]


def goals(rows: list) -> list:
    """(goal, result, met) for each goal over every size, with the worst case named."""
    autodist = [r for r in rows if r["case"].builder and _ok(r) and _ok(_reference(rows, r))]
    out = []

    def worst(items, describe, limit):
        """items: (value, row); met when every value <= limit, None when none measured."""
        if not items:
            return "not measured", None
        value, row = max(items, key=lambda item: item[0])
        where = f"{row['megabytes']:g} MB, {row['case'].table} `{row['case'].system}`"
        return f"worst {describe(value)} ({where})", value <= limit

    # Issue 30's time goals are for one node with two replicas (its table); of the
    # two-node run it asks equal weights and memory, and its start-up is shown apart.
    judged = [r for r in autodist if r["case"].judged_for_speed]

    def first_step_over(row: dict) -> float:
        return row["first_step"] - _reference(rows, row)["first_step"]

    first = [(first_step_over(r), r) for r in judged]
    out.append((f"first step <= the reference's + {FIRST_STEP_ALLOWANCE_S:g} s "
                "(one node, two replicas)",
                *worst(first, lambda v: f"{v:+.1f} s", FIRST_STEP_ALLOWANCE_S)))
    start = [(_start_up(r) - _start_up(_reference(rows, r)), r) for r in judged]
    out.append((f"build + first step <= the reference's + {FIRST_STEP_ALLOWANCE_S:g} s "
                "(one node, two replicas)",
                *worst(start, lambda v: f"{v:+.1f} s", FIRST_STEP_ALLOWANCE_S)))
    nodes = [(first_step_over(r), r) for r in autodist if r["case"].nodes > 1]
    out.append(("first step on two nodes (shown, not a goal: the worker's start and its "
                "copy of the weights)", worst(nodes, lambda v: f"{v:+.1f} s", math.inf)[0],
                None))
    memory = [(r["peak_rss_gb"] - memory_bound_gb(rows, r), r) for r in autodist]
    out.append((f"peak RSS <= the reference's + one copy of the training state + "
                f"{MEMORY_ALLOWANCE_GB * 1024:.0f} MB (every node)",
                *worst(memory, lambda v: f"{v:+.2f} GB from the bound", 0.0)))
    fit = [(r["run"] / _reference(rows, r)["run"], r) for r in judged
           if r["case"].table == "fit" and r["megabytes"] >= FIT_RATIO_FROM_MB]
    out.append((f"`fit` <= {FIT_RATIO:g}x plain Keras's from {FIT_RATIO_FROM_MB} MB "
                "(one node, two replicas)",
                *worst(fit, lambda v: f"{v:.2f}x", FIT_RATIO)))
    loop = []
    for r in autodist:
        if (r["case"].table == "loop" and r["case"].copy_back == "every_call"
                and r["megabytes"] >= LOOP_RATIO_FROM_MB):
            fit_row = next((f for f in autodist if f["megabytes"] == r["megabytes"]
                            and f["case"] == Case("fit", r["case"].builder,
                                                  r["case"].builder)), None)
            if fit_row:
                loop.append((r["later"] / fit_row["later"], r))
    out.append((f"`ad.function`'s later calls <= {LOOP_RATIO:g}x `fit`'s later steps from "
                f"{LOOP_RATIO_FROM_MB} MB",
                *worst(loop, lambda v: f"{v:.2f}x", LOOP_RATIO)))
    diffs = [(r["max_abs_diff"] if r.get("max_abs_diff") is not None else math.inf, r)
             for r in autodist]
    out.append((f"trained weights equal the reference's (max abs diff <= {TOLERANCE:g})",
                *worst(diffs, lambda v: f"{v:.1e}", TOLERANCE)))
    return out


def first_touch_seconds_per_gib() -> float:
    """Seconds to allocate and first write 1 GiB here: memory the machine has just
    freed may cost far more to touch again than to write (a VM's host takes it back)."""
    import numpy as np
    began = time.perf_counter()
    np.ones(_GiB // 4, dtype=np.float32)
    return time.perf_counter() - began


def format_section(rows: list, command: str, info: dict, touch_s: float,
                   builders: list) -> str:
    verdicts = {True: ": **met**", False: ": **not met**", None: ""}
    goal_lines = ["| goal | result |", "|---|---|"] + [
        f"| {goal} | {result}{verdicts[met]} |" for goal, result, met in goals(rows)]
    return "\n".join([
        BEGIN, "## Start-up and memory vs. the model's bytes (`model_scale`)", "",
        f"**Measures:** `Input(W) -> Dense(W) -> Dense(1)`, 8 batches of {ROWS} rows, trained "
        f"on one device and through AutoDist ({', '.join(f'`{b}`' for b in builders)}; one "
        "node with two CPU replicas unless named), written three ways: Keras `fit` (of a "
        "`tf.data` pipeline without autotuning, whose pauses are tf.data's: see the notes), a "
        "custom loop, `tf.compat.v1`. Each run a fresh process, interleaved per size, one "
        "run each; each AutoDist run's trained weights compared with its single-device "
        "reference's.", "",
        "**Goal** (issue 30): start-up and memory grow with the graph, not with the "
        "bytes, at every size (the table below).", "",
        *goal_lines, "",
        f"Measured {info['date']} on {info['cores']} cores ({info['cpu']}), TensorFlow "
        f"{info['tf']}, Python {info['python']}; 1-minute load average {info['load']} at "
        f"the end. Allocating and first writing 1 GiB took {touch_s:.2f} s here (freed "
        "memory goes back to the VM's host, so every new buffer costs that again). "
        f"Command: `{command}`.", "",
        "*memory bound* = the reference's peak + one copy of the training state + "
        f"{MEMORY_ALLOWANCE_GB * 1024:.0f} MB; a two-node run shows each node's peak. What "
        "each system holds, and why: [notes](notes/model_scale.md).", "",
        "**Keras `fit`** (reference: `keras`)", "", table(rows, "fit"), "",
        "**Custom loop** (reference: `tf.function`)", "", table(rows, "loop"), "",
        "**`tf.compat.v1`** (reference: a plain session)", "", table(rows, "graph"), "",
        END])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[16, 256, 1024, 3072])
    parser.add_argument("--builders", nargs="+", default=["AllReduce", "PartitionedPS"])
    parser.add_argument("--optimizer", default="sgd", choices=sorted(_GRAPH_OPTIMIZERS))
    parser.add_argument("--two-nodes-up-to-mb", type=float, default=1024,
                        help="the largest size also run on a two-node emulated cluster")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per run")
    parser.add_argument("--out", default=os.path.join(report.REPO, "docs", "benchmarks.md"))
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--case", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        fields, width, optimizer, save = args.case
        case = Case(**json.loads(fields))
        figures = RUNNERS[case.table](case, int(width), optimizer, args.spec, save)
        print(_RESULT_TAG + json.dumps(figures), flush=True)
        return
    touch_s = first_touch_seconds_per_gib()
    with tempfile.TemporaryDirectory(prefix="model_scale.") as directory:
        rows = measure(args.sizes_mb, args.builders, args.optimizer,
                       args.two_nodes_up_to_mb, args.timeout, directory)
    section = format_section(rows, report.command_line("benchmarks/model_scale.py", parser,
                                                       args),
                             report.machine_info(), touch_s, args.builders)
    print(section)
    if not args.no_write:
        report.write_section(args.out, section, BEGIN, END)


if __name__ == "__main__":
    main()
