"""AutoDist's start-up time and memory as the model's bytes grow, against plain Keras.

For every size, a Keras 3 model ``Input(W) -> Dense(W) -> Dense(1)`` whose weights
take about that many bytes is fitted on 8 batches of 32 rows, once with plain
Keras on one device and once through AutoDist (``configs/local_2cpu.yml``: one
node, two CPU replicas, ``AllReduce``), each in a fresh process, the two
interleaved per size. Per run:

* ``first step``: from the call to ``fit`` to the end of its first batch (for
  AutoDist: tracing, lifting, building, compiling, rewriting, initializing);
* ``fit``: the whole call;
* ``later steps``: the median of batches 2-8;
* ``peak RSS``: the process's maximum resident memory;
* ``GraphDef``: the bytes of the single-device graph AutoDist lifts.

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
_RESULT_TAG = "MODEL_SCALE_RESULT "


def width_for(megabytes: float) -> int:
    """The width W whose W x W float32 kernel takes about ``megabytes``."""
    return int(math.sqrt(megabytes * 2 ** 20 / 4))


def run_case(mode: str, width: int, optimizer: str) -> dict:
    """One fit, in this process; returns its figures."""
    import resource

    import keras
    import numpy as np

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

    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS * BATCHES, width)).astype("float32")
    y = rng.normal(size=(ROWS * BATCHES, 1)).astype("float32")
    graph_bytes = None
    if mode == "autodist":
        from autodist import AutoDist
        from autodist.strategy import AllReduce
        ad = AutoDist(os.path.join(report.REPO, "configs", "local_2cpu.yml"), AllReduce())
        with ad.scope():
            model = build()
    else:
        model = build()
    started = time.perf_counter()
    times = StepTimes(started)
    model.fit(x, y, batch_size=ROWS, epochs=1, shuffle=False, verbose=0, callbacks=[times])
    fit_seconds = time.perf_counter() - started
    if mode == "autodist":
        graph_bytes = model._autodist_fit.step.session.distributed.item.graph_def.ByteSize()  # pylint: disable=protected-access
    later = [b - a for a, b in zip(times.ends[1:], times.ends[2:])]
    return {"first_step": times.ends[0], "fit": fit_seconds, "later": statistics.median(later),
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20,
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


def _table(rows: list) -> str:
    lines = ["| weights | optimizer | system | first step | fit | later steps | peak RSS | "
             "GraphDef |", "|---|---|---|--:|--:|--:|--:|--:|"]
    for row in rows:
        lines.append(
            f"| {row['megabytes']:g} MB | {row['optimizer']} | {row['mode']} | "
            f"{_cell(row, 'first_step', '{:.1f} s')} | {_cell(row, 'fit', '{:.1f} s')} | "
            f"{_cell(row, 'later', '{:.2f} s')} | {_cell(row, 'peak_rss_gb', '{:.2f} GB')} | "
            f"{_cell(row, 'graph_mb', '{:.2f} MB')} |")
    errors = [f"- {row['megabytes']:g} MB, {row['mode']}: {row['error']}"
              for row in rows if "error" in row]
    return "\n".join(lines + ([""] + errors if errors else []))


def _findings(rows: list) -> str:
    """Per size: AutoDist's start-up beyond plain Keras's, and its memory beyond plain
    Keras's in copies of the training state, against the goals."""
    lines = []
    for keras_row, autodist_row in zip(rows[::2], rows[1::2]):
        size = f"{keras_row['megabytes']:g} MB"
        if "error" in autodist_row or "error" in keras_row:
            lines.append(f"- {size}: a run failed (see above).")
            continue
        state_gb = (keras_row["width"] ** 2 * 4 / 2 ** 30
                    * STATE_COPIES.get(keras_row["optimizer"].lower(), 1))
        extra_copies = (autodist_row["peak_rss_gb"] - keras_row["peak_rss_gb"]) / state_gb
        lines.append(
            f"- {size}: first step {autodist_row['first_step'] - keras_row['first_step']:+.1f} s "
            f"against plain Keras; peak RSS {extra_copies:+.1f} copies of the training state "
            f"(goal: at most +1, **{'met' if extra_copies <= 1 else 'not met'}**).")
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
        for mode in ("keras", "autodist"):  # interleaved, size by size
            row = {"megabytes": megabytes, "width": width, "optimizer": args.optimizer,
                   "mode": mode, **_run_subprocess(mode, width, args.optimizer, args.timeout)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    table = _table(rows)
    findings = _findings(rows)
    print(table + "\n\n" + findings)
    if args.no_write:
        return
    info = report.machine_info()
    section = "\n".join([
        BEGIN, "## Start-up and memory vs. the model's bytes (`model_scale`)", "",
        "Keras 3 `Input(W) -> Dense(W) -> Dense(1)`, `fit` of 8 batches of 32 rows; plain "
        "Keras on one device against AutoDist on one node with two CPU replicas "
        "(`AllReduce`); each run a fresh process, the two interleaved per size, one run "
        "each. Goal: start-up grows with the graph, not with the bytes; peak memory at most "
        "one more copy of the training state than plain Keras.", "",
        f"Measured {info['date']} on {info['cores']} cores ({info['cpu']}), TensorFlow "
        f"{info['tf']}, Python {info['python']}; 1-minute load average {info['load']} at "
        f"the end. Command: `{report.command_line('benchmarks/model_scale.py', parser, args)}`.",
        "", table, "", findings, "", END])
    report.write_section(args.out, section, BEGIN, END)


if __name__ == "__main__":
    main()
