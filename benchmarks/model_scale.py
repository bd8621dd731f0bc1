"""AutoDist's start-up time and memory as the model's bytes grow, against plain Keras.

For every size, a Keras 3 model ``Input(W) -> Dense(W) -> Dense(1)`` whose weights
take about that many bytes trains on 8 batches of 32 rows, with plain Keras on
one device and through AutoDist (``configs/local_2cpu.yml``: one node, two CPU
replicas, ``AllReduce``), each run in a fresh process, the runs interleaved per
size: ``fit``, and a custom loop (``tf.function`` against ``ad.function`` copying
back after every call, and on request). Per ``fit`` (AutoDist also on a one-replica spec, which shows AutoDist's own
memory without a second replica's gradients):

* ``first step``: from the call to ``fit`` to the end of its first batch (for
  AutoDist: tracing, lifting, building, compiling, rewriting, initializing);
* ``fit``: the whole call;
* ``later steps``: the median of batches 2-8;
* ``peak RSS``: the process's maximum resident memory;
* ``GraphDef``: the bytes of the single-device graph AutoDist lifts.

Per loop: the first call, the median of calls 2-8, the final ``copy_to_model``
(on request), the whole loop and the peak RSS.

The goal (issue 30): AutoDist's start-up grows with the graph, not with the
bytes: a 1 GB model starts about as fast as a 16 MB one, plus the time to move
its bytes once; peak memory holds at most one more copy of the training state
than plain Keras.

Usage:
    python benchmarks/model_scale.py                       # 16 MB, 256 MB, 1 GB; writes docs
    python benchmarks/model_scale.py --sizes-mb 16 --no-write
    python benchmarks/model_scale.py --sizes-mb 3072       # above protobuf's 2 GB
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

import report

report.use_job_environment()

BEGIN = "<!-- model_scale:begin -->"
END = "<!-- model_scale:end -->"
ROWS, BATCHES = 32, 8
# Copies of the weights in a Keras optimizer's training state: the weights and their slots.
STATE_COPIES = {"sgd": 1, "adagrad": 2, "rmsprop": 2, "adam": 3, "adamw": 3}
# What AutoDist itself adds at any size (its modules, the session): the 16 MB runs show
# about 50 MB; the memory goal allows it beside the one copy of the training state.
FIXED_ALLOWANCE_GB = 0.0625
_RESULT_TAG = "MODEL_SCALE_RESULT "


def width_for(megabytes: float) -> int:
    """The width W whose W x W float32 kernel takes about ``megabytes``."""
    return int(math.sqrt(megabytes * 2 ** 20 / 4))


FIT_MODES = ("keras", "autodist", "autodist, 1 replica")
LOOP_MODES = ("tf.function", "ad.function", "ad.function on request")


def _autodist(replicas: int = 2):
    """AutoDist on this machine as one node: the repository's two-replica spec, or a
    one-replica spec (AutoDist's own memory, without a second replica's gradients)."""
    import tempfile

    from autodist import AutoDist
    from autodist.strategy import AllReduce
    spec = os.path.join(report.REPO, "configs", "local_2cpu.yml")
    if replicas == 1:
        spec = os.path.join(tempfile.mkdtemp(prefix="model_scale."), "one_replica.yml")
        with open(spec, "w", encoding="utf-8") as f:
            f.write("nodes:\n  - address: localhost\n    cpus: [0]\n    chief: true\n")
    return AutoDist(spec, AllReduce())


def _data(width: int) -> tuple:
    import numpy as np
    rng = np.random.default_rng(0)
    return (rng.normal(size=(ROWS * BATCHES, width)).astype("float32"),
            rng.normal(size=(ROWS * BATCHES, 1)).astype("float32"))


def _peak_rss_gb() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def run_loop_case(mode: str, width: int, optimizer_name: str) -> dict:
    """One custom training loop, in this process; returns its figures."""
    import contextlib

    import keras
    import tensorflow as tf

    ad = _autodist() if mode != "tf.function" else None
    with ad.scope() if ad else contextlib.nullcontext():
        model = keras.Sequential([keras.Input((width,)), keras.layers.Dense(width),
                                  keras.layers.Dense(1)])
        optimizer = keras.optimizers.get(optimizer_name)

    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    if ad is None:
        step = tf.function(train_step)
    else:
        step = ad.function(train_step, copy_back="on_request" if mode.endswith("request")
                           else "every_call")
    x, y = _data(width)
    calls, started = [], time.perf_counter()
    for batch in range(BATCHES):
        begun = time.perf_counter()
        float(step(x[batch * ROWS:(batch + 1) * ROWS], y[batch * ROWS:(batch + 1) * ROWS]))
        calls.append(time.perf_counter() - begun)
    begun = time.perf_counter()
    if hasattr(step, "copy_to_model"):
        step.copy_to_model()
    copy = time.perf_counter() - begun
    return {"first_step": calls[0], "later": statistics.median(calls[1:]), "copy": copy,
            "fit": time.perf_counter() - started, "peak_rss_gb": _peak_rss_gb()}


def run_case(mode: str, width: int, optimizer: str) -> dict:
    """One fit (or, for ``LOOP_MODES``, a custom loop), in this process; returns its
    figures."""
    if mode in LOOP_MODES:
        return run_loop_case(mode, width, optimizer)
    import keras

    class StepTimes(keras.callbacks.Callback):
        autodist_reads_weights = False  # a timer: AutoDist need not copy weights per batch

        def __init__(self, started: float):
            super().__init__()
            self.ends, self._started = [], started

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter() - self._started)

    def build() -> keras.Model:
        model = keras.Sequential([keras.Input((width,)), keras.layers.Dense(width),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=optimizer, loss="mse")
        return model

    x, y = _data(width)
    graph_bytes = None
    if mode.startswith("autodist"):
        with _autodist(replicas=1 if mode.endswith("1 replica") else 2).scope():
            model = build()
    else:
        model = build()
    started = time.perf_counter()
    times = StepTimes(started)
    model.fit(x, y, batch_size=ROWS, epochs=1, shuffle=False, verbose=0, callbacks=[times])
    fit_seconds = time.perf_counter() - started
    if mode.startswith("autodist"):
        graph_bytes = model._autodist_fit.step.session.distributed.item.graph_def.ByteSize()  # pylint: disable=protected-access
    later = [b - a for a, b in zip(times.ends[1:], times.ends[2:])]
    return {"first_step": times.ends[0], "fit": fit_seconds, "later": statistics.median(later),
            "peak_rss_gb": _peak_rss_gb(),
            "graph_mb": None if graph_bytes is None else graph_bytes / 2 ** 20}


def _run_subprocess(mode: str, width: int, optimizer: str, timeout: float) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--case", mode, str(width), optimizer]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in done.stdout.splitlines():
        if line.startswith(_RESULT_TAG):
            return json.loads(line[len(_RESULT_TAG):])
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"exit code {done.returncode}: {tail[:200]}"}


def _cell(row: dict, key: str, fmt: str) -> str:
    if "error" in row:
        return "failed"
    value = row.get(key)
    return "-" if value is None else fmt.format(value)


def _errors(rows: list) -> list:
    return [f"- {row['megabytes']:g} MB, {row['mode']}: {row['error']}"
            for row in rows if "error" in row]


# A table's columns: (heading, key of a run's figures, format).
FIT_COLUMNS = (("first step", "first_step", "{:.1f} s"), ("fit", "fit", "{:.1f} s"),
               ("later steps", "later", "{:.2f} s"), ("peak RSS", "peak_rss_gb", "{:.2f} GB"),
               ("GraphDef", "graph_mb", "{:.2f} MB"))
LOOP_COLUMNS = (("first call", "first_step", "{:.1f} s"), ("later calls", "later", "{:.2f} s"),
                ("copy_to_model", "copy", "{:.2f} s"), ("loop", "fit", "{:.1f} s"),
                ("peak RSS", "peak_rss_gb", "{:.2f} GB"))


def _table(rows: list, columns: tuple, system: str = "{}") -> str:
    """Rows of runs as a Markdown table of ``columns``, the failures listed below it;
    ``system`` formats the mode's name."""
    lines = ["| weights | optimizer | system | " + " | ".join(c[0] for c in columns) + " |",
             "|---|---|---|" + "--:|" * len(columns)]
    for row in rows:
        cells = [f"{row['megabytes']:g} MB", row["optimizer"], system.format(row["mode"])]
        cells += [_cell(row, key, fmt) for _, key, fmt in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + ([""] + _errors(rows) if _errors(rows) else []))


def _findings(rows: list) -> str:
    """Per size: AutoDist's start-up beyond plain Keras's, and its memory beyond plain
    Keras's in copies of the training state, against the goals (AutoDist's own
    memory: the one-replica run; two replicas add a second replica's gradients)."""
    lines = []
    for keras_row, two, one in zip(rows[::3], rows[1::3], rows[2::3]):
        size = f"{keras_row['megabytes']:g} MB"
        if any("error" in row for row in (keras_row, two, one)):
            lines.append(f"- {size}: a run failed (see above).")
            continue
        state_gb = (keras_row["width"] ** 2 * 4 / 2 ** 30
                    * STATE_COPIES.get(keras_row["optimizer"].lower(), 1))
        own, both = ((row["peak_rss_gb"] - keras_row["peak_rss_gb"]) / state_gb
                     for row in (one, two))
        met = one["peak_rss_gb"] - keras_row["peak_rss_gb"] <= state_gb + FIXED_ALLOWANCE_GB
        lines.append(
            f"- {size}: first step {two['first_step'] - keras_row['first_step']:+.1f} s "
            f"against plain Keras; peak RSS {own:+.1f} copies of the training state with one "
            f"replica (goal: at most +1 and {FIXED_ALLOWANCE_GB * 1024:.0f} MB, "
            f"**{'met' if met else 'not met'}**), {both:+.1f} with two.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[16, 256, 1024])
    parser.add_argument("--optimizer", default="sgd", help="a Keras optimizer's name")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--out", default=os.path.join(report.REPO, "docs", "benchmarks.md"))
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--case", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        mode, width, optimizer = args.case
        print(_RESULT_TAG + json.dumps(run_case(mode, int(width), optimizer)), flush=True)
        return
    rows = []
    for megabytes in args.sizes_mb:
        width = width_for(megabytes)
        for mode in FIT_MODES + LOOP_MODES:  # interleaved, size by size
            row = {"megabytes": megabytes, "width": width, "optimizer": args.optimizer,
                   "mode": mode, **_run_subprocess(mode, width, args.optimizer, args.timeout)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    fit_rows = [row for row in rows if row["mode"] in FIT_MODES]
    table = _table(fit_rows, FIT_COLUMNS)
    findings = _findings(fit_rows)
    loops = _table([row for row in rows if row["mode"] in LOOP_MODES], LOOP_COLUMNS, "`{}`")
    print(table + "\n\n" + findings + "\n\n" + loops)
    if args.no_write:
        return
    info = report.machine_info()
    section = "\n".join([
        BEGIN, "## Start-up and memory vs. the model's bytes (`model_scale`)", "",
        "Keras 3 `Input(W) -> Dense(W) -> Dense(1)`, 8 batches of 32 rows; plain "
        "Keras on one device against AutoDist on one node with two CPU replicas "
        "(`AllReduce`), and with one (AutoDist's own memory: two replicas each compute a "
        "whole gradient); each run a fresh process, interleaved per size, one run each. "
        "Goal: start-up grows with the graph, not with the bytes; peak memory at most one "
        "more copy of the training state than plain Keras.", "",
        f"Measured {info['date']} on {info['cores']} cores ({info['cpu']}), TensorFlow "
        f"{info['tf']}, Python {info['python']}; 1-minute load average {info['load']} at "
        f"the end. Command: `{report.command_line('benchmarks/model_scale.py', parser, args)}`.",
        "", table, "", findings, "",
        "The same training in a custom loop: `tf.function` on one device against "
        "`ad.function` copying the weights back after every call (the default) and on "
        "request (`copy_back=\"on_request\"`, one `copy_to_model()` after the loop).", "",
        loops, "", END])
    report.write_section(args.out, section, BEGIN, END)


if __name__ == "__main__":
    main()
