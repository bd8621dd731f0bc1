"""Step time of a multi-input multi-output Keras model: plain Keras against AutoDist.

The model is written as the Keras functional-API guide writes its ticket
classifier: a title (10 word ids) and a body (100 word ids) each go through an
``Embedding(10000, 64)`` and an LSTM (128 and 32 units), are concatenated with
12 tag features, and feed two heads, a priority (1 logit, binary
cross-entropy) and a department (4 logits, categorical cross-entropy), with
``loss_weights`` 1.0 and 0.2, RMSprop (1e-3). ``fit`` runs 4 epochs of 40
batches of 32 rows of synthetic data: 115 timed steps a job, as this VM's
speed drifts by a third over seconds, within a job as between jobs.

Systems, each a fresh process with TensorFlow's default thread pools (as a
user runs it):

* ``keras``: plain Keras on one device (the reference);
* ``AllReduce``: AutoDist, one node with two CPU replicas (``configs/local_2cpu.yml``);
* ``AllReduce, 1 replica``: AutoDist on one CPU replica: what AutoDist's own
  machinery costs, without a second replica's work;
* ``MirroredStrategy``: ``tf.distribute.MirroredStrategy`` over two logical CPU
  devices, the peer;
* ``AllReduce and keras, one process``: AutoDist's two replicas and plain Keras
  in one process, a plain-Keras step run after each of AutoDist's (its
  ``train_function``, outside AutoDist's timed batch): a ratio this VM's drift
  over seconds, which moves whole jobs, cannot move.

Method: rounds are interleaved (round 1 runs every system once, then round 2,
...). In a job a callback times ``on_train_batch_begin`` -> ``on_train_batch_end``
of the batches after the first ``--warmup`` and reports their median; a
system's figure is the median over rounds. Each round's own ratio (AutoDist's
two replicas against plain Keras, run one after the other) is shown too. The
timer reads no weights and says so (``autodist_reads_weights = False``).

Goal (issue 29): AutoDist's step on one node with two replicas within
``GOAL_RATIO`` of plain Keras's.

Usage:
    python benchmarks/keras_mimo.py                  # writes docs/benchmarks.md
    python benchmarks/keras_mimo.py --rounds 1 --no-write

The table is printed and, unless ``--no-write``, written into ``--out`` between
``<!-- keras_mimo:begin -->`` and ``<!-- keras_mimo:end -->``.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys

import report

BEGIN = "<!-- keras_mimo:begin -->"
END = "<!-- keras_mimo:end -->"
HEADING, ANCHOR = next(s for s in report.SECTIONS if s[0].endswith("(`keras_mimo`)"))
INTERLEAVED = "AllReduce and keras, one process"
SYSTEMS = ("keras", "AllReduce", "AllReduce, 1 replica", "MirroredStrategy", INTERLEAVED)
GOAL_RATIO = 1.3
WORDS, TAGS, DEPARTMENTS = 10000, 12, 4
TITLE_WORDS, BODY_WORDS = 10, 100
ROWS, BATCH = 1280, 32
_RESULT_TAG = "KERAS_MIMO_RESULT "


def _data():
    import numpy as np
    rng = np.random.default_rng(0)
    inputs = {"title": rng.integers(0, WORDS, size=(ROWS, TITLE_WORDS)),
              "body": rng.integers(0, WORDS, size=(ROWS, BODY_WORDS)),
              "tags": rng.integers(0, 2, size=(ROWS, TAGS)).astype("float32")}
    targets = {"priority": rng.random((ROWS, 1)).astype("float32"),
               "department": rng.integers(0, 2, size=(ROWS, DEPARTMENTS)).astype("float32")}
    return inputs, targets


def _build():
    import keras
    from keras import layers
    keras.utils.set_random_seed(1)
    title_in = keras.Input((None,), name="title")
    body_in = keras.Input((None,), name="body")
    tags_in = keras.Input((TAGS,), name="tags")
    title = layers.LSTM(128)(layers.Embedding(WORDS, 64)(title_in))
    body = layers.LSTM(32)(layers.Embedding(WORDS, 64)(body_in))
    features = layers.concatenate([title, body, tags_in])
    model = keras.Model([title_in, body_in, tags_in],
                        [layers.Dense(1, name="priority")(features),
                         layers.Dense(DEPARTMENTS, name="department")(features)])
    model.compile(optimizer=keras.optimizers.RMSprop(1e-3),
                  loss=[keras.losses.BinaryCrossentropy(from_logits=True),
                        keras.losses.CategoricalCrossentropy(from_logits=True)],
                  loss_weights=[1.0, 0.2])
    return model


def run_job(system: str, epochs: int, warmup: int) -> dict:
    """Builds and fits the model under ``system`` in this process; the median step in s
    (for ``INTERLEAVED`` also plain Keras's, and the median ratio of a batch pair)."""
    import time
    import keras
    import tensorflow as tf

    class Timer(keras.callbacks.Callback):
        autodist_reads_weights = False

        def __init__(self, then=None):
            super().__init__()
            self.times, self._start = [], 0.0
            self._then, self.then_times = then, []

        def on_train_batch_begin(self, batch, logs=None):
            self._start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter() - self._start)
            if self._then is not None:
                start = time.perf_counter()
                self._then()
                self.then_times.append(time.perf_counter() - start)

    then = None
    if system == INTERLEAVED:
        plain = _build()
        plain.make_train_function()
        batches = iter(tf.data.Dataset.from_tensor_slices(_data()).batch(BATCH).repeat())
        then = functools.partial(plain.train_function, batches)
    if system == "keras":
        model = _build()
    elif system == "MirroredStrategy":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
            model = _build()
    else:
        from autodist import AutoDist
        from autodist.strategy import get_builder
        spec = (report.one_replica_spec() if system.endswith("1 replica")
                else os.path.join(report.REPO, "configs", "local_2cpu.yml"))
        with AutoDist(spec, get_builder("AllReduce")).scope():
            model = _build()
    timer = Timer(then)
    inputs, targets = _data()
    model.fit(inputs, targets, epochs=epochs, batch_size=BATCH, verbose=0, callbacks=[timer])
    result = {"system": system, "step_s": statistics.median(timer.times[warmup:]),
              "steps": len(timer.times) - warmup}
    if then is not None:
        pairs = list(zip(timer.times[warmup:], timer.then_times[warmup:]))
        result.update(keras_step_s=statistics.median(k for _, k in pairs),
                      pair_ratio=statistics.median(a / k for a, k in pairs))
    return result


def measure(args) -> tuple:
    """System -> its median step of every round (None for a failed job); and per round
    of ``INTERLEAVED``, (its plain-Keras median step, its median batch-pair ratio)."""
    steps = {system: [] for system in args.systems}
    paired = []
    for round_index in range(args.rounds):
        for system in args.systems:
            command = [sys.executable, os.path.abspath(__file__), "--job", system,
                       "--epochs", str(args.epochs), "--warmup", str(args.warmup)]
            env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
            try:
                done = subprocess.run(command, capture_output=True, text=True, env=env,
                                      timeout=args.timeout)
                lines = [line for line in done.stdout.splitlines()
                         if line.startswith(_RESULT_TAG)]
                result = json.loads(lines[-1][len(_RESULT_TAG):]) if lines else None
                error = None if result else (done.stderr.strip().splitlines() or ["no output"])[-1]
            except subprocess.TimeoutExpired:
                result, error = None, f"timed out after {args.timeout:.0f} s"
            steps[system].append(result["step_s"] if result else None)
            shown = f"{result['step_s'] * 1e3:.1f} ms" if result else f"failed: {error}"
            if result and "pair_ratio" in result:
                paired.append((result["keras_step_s"], result["pair_ratio"]))
                shown += (f", plain Keras {result['keras_step_s'] * 1e3:.1f} ms, "
                          f"pair ratio {result['pair_ratio']:.2f}")
            print(f"round {round_index + 1} {system}: {shown}", flush=True)
    return steps, paired


def summarize(steps: dict) -> dict:
    """System -> (median step over the rounds, or None, failed rounds)."""
    out = {}
    for system, times in steps.items():
        good = [t for t in times if t is not None]
        out[system] = (statistics.median(good) if good else None, len(times) - len(good))
    return out


def round_ratios(steps: dict) -> list:
    """Per round in which both ran, AutoDist's two-replica step over plain Keras's."""
    return [two / keras for keras, two in zip(steps.get("keras", []), steps.get("AllReduce", []))
            if keras and two]


def _ms(value) -> str:
    return "failed" if value is None else f"{value * 1e3:.1f}"


def format_markdown(table: dict, ratios: list, paired: list, args, command: str) -> str:
    info = report.machine_info()
    reference = table.get("keras", (None, 0))[0]
    lines = [
        BEGIN, f"## {HEADING}", "",
        "**Measures:** the median `fit` step of the Keras functional guide's multi-input "
        "multi-output model (title and body embeddings and LSTMs, tag features, two heads "
        "with `loss_weights`; RMSprop, 32 rows per step) under plain Keras, AutoDist "
        "(`AllReduce`, two CPU replicas, and one) and `MirroredStrategy` (two logical CPUs).", "",
        f"**Goal:** AutoDist with two replicas within {GOAL_RATIO}x plain Keras's step "
        "(issue 29).", "",
        f"Measured {info['date']} on {info['cores']} cores ({info['cpu']}), TensorFlow "
        f"{info['tf']}, Python {info['python']}; TensorFlow's default thread pools; median over "
        f"{args.rounds} interleaved rounds of fresh jobs, each the median of its steps after "
        f"{args.warmup} warm-up steps; 1-minute load {info['load']} at the end.", "",
        f"Command: `{command}`", "",
        "| system | median step ms | vs plain Keras | failed rounds |",
        "|---|--:|--:|--:|"]
    # INTERLEAVED's ratio is against the plain-Keras steps of its own process.
    pair = statistics.median(ratio for _, ratio in paired) if paired else None
    for system, (step, failed) in table.items():
        ratio = f"{step / reference:.2f}x" if step and reference else "n/a"
        if system == INTERLEAVED:
            ratio = f"{pair:.2f}x (its own Keras)" if pair else "n/a"
        lines.append(f"| {system} | {_ms(step)} | {ratio} | {failed} |")
    lines += ["", "Findings:", ""]
    two = table.get("AllReduce", (None, 0))[0]
    if two and reference:
        verdict = "met" if two / reference <= GOAL_RATIO else "**not met**"
        lines.append(f"- AutoDist, two replicas: {two / reference:.2f}x plain Keras's step; "
                     f"goal <= {GOAL_RATIO}x {verdict}.")
    if ratios:
        lines.append("- Round by round, two replicas against plain Keras: "
                     + ", ".join(f"{r:.2f}x" for r in ratios)
                     + f" (median {statistics.median(ratios):.2f}x).")
    inner = table.get(INTERLEAVED, (None, 0))[0]
    if inner and pair:
        verdict = "met" if pair <= GOAL_RATIO else "**not met**"
        lines.append(
            f"- In one process, batch by batch: AutoDist {_ms(inner)} ms, plain Keras "
            f"{_ms(statistics.median(k for k, _ in paired))} ms; a batch pair's ratio, median "
            f"over the rounds, {pair:.2f}x (rounds: "
            + ", ".join(f"{ratio:.2f}x" for _, ratio in paired)
            + f"); goal <= {GOAL_RATIO}x {verdict}.")
    peer = table.get("MirroredStrategy", (None, 0))[0]
    if two and peer:
        lines.append(f"- Against `MirroredStrategy` on the same two logical CPUs AutoDist's step "
                     f"is {peer / two:.2f}x as fast.")
    one = table.get("AllReduce, 1 replica", (None, 0))[0]
    if two and one:
        lines.append(f"- One replica: {_ms(one)} ms; the second replica on the same two cores "
                     f"changes the step by {(two - one) * 1e3:+.1f} ms (where the time goes: "
                     "[the note](notes/keras_mimo.md)).")
    lines.append(END)
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS,
                        help="systems to time (default: all)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default: 5)")
    parser.add_argument("--epochs", type=int, default=4, help="epochs per job (default: 4)")
    parser.add_argument("--warmup", type=int, default=45,
                        help="untimed batches first (default: 45)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds per job (default: 300)")
    parser.add_argument("--out", default=os.path.join(report.REPO, "docs", "benchmarks.md"),
                        help="markdown file whose keras_mimo section is rewritten")
    parser.add_argument("--no-write", action="store_true", help="only print the table")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job:
        if report.REPO not in sys.path:
            sys.path.insert(0, report.REPO)
        print(_RESULT_TAG + json.dumps(run_job(args.job, args.epochs, args.warmup)), flush=True)
        return 0
    if args.warmup >= args.epochs * ROWS // BATCH:
        parser.error(f"--warmup {args.warmup} leaves no step of {args.epochs} epochs of "
                     f"{ROWS // BATCH} batches to time")
    steps, paired = measure(args)
    table, ratios = summarize(steps), round_ratios(steps)
    for system, (step, failed) in table.items():
        print(f"{system}: {_ms(step)} ms per step ({failed} failed rounds)")
    if ratios:
        print("two replicas / keras per round: " + " ".join(f"{r:.2f}" for r in ratios))
    if not args.no_write:
        command = report.command_line("benchmarks/keras_mimo.py", parser, args)
        markdown = format_markdown(table, ratios, paired, args, command)
        report.write_section(args.out, markdown, BEGIN, END)
        report.add_contents_entry(args.out, HEADING, ANCHOR)
        print(f"wrote the keras_mimo section of {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
