"""Step time of a multi-input multi-output Keras model: plain Keras against AutoDist.

The model is written as the Keras functional-API guide writes its ticket
classifier: a title (10 word ids) and a body (100 word ids) each go through an
``Embedding(10000, 64)`` and an LSTM (128 and 32 units), are concatenated with
12 tag features, and feed two heads, a priority (1 logit, binary
cross-entropy) and a department (4 logits, categorical cross-entropy), with
``loss_weights`` 1.0 and 0.2, RMSprop (1e-3). ``fit`` runs 4 epochs of 40
batches of 32 rows of synthetic data: 115 timed steps a system and round.

Systems, each in a process of its own with TensorFlow's default thread pools
(as a user runs it):

* ``keras``: plain Keras on one device (the reference);
* ``AllReduce``: AutoDist, one node with two CPU replicas (``configs/local_2cpu.yml``);
* ``AllReduce, 1 replica``: AutoDist on one CPU replica: what AutoDist's own
  machinery costs, without a second replica's work;
* ``MirroredStrategy``: ``tf.distribute.MirroredStrategy`` over two logical CPU
  devices, the peer.

Method: the systems' processes train in lockstep, one step each in turn (the
order reversed every other cycle): each waits before a batch until the
coordinator lets it run one, times the batch's ``train_function`` call (no
callback in ``fit``: ``lockstep.time_steps``), and reports back before the next
process runs. So
every system runs alone on the cores, and this VM's speed, which drifts by a
third over seconds, moves the steps of one cycle alike. A round is one such
run of fresh processes; in it a system's figure is the median of its steps
after the first ``--warmup``, and the two-replica ratio is the median over
the cycles of AutoDist's step over plain Keras's in the same cycle. The table
gives medians over the rounds.

Goal (issue 29): AutoDist's step on one node with two replicas within
``GOAL_RATIO`` of plain Keras's (the median per-cycle ratio).

Usage:
    python benchmarks/keras_mimo.py                  # writes docs/benchmarks.md
    python benchmarks/keras_mimo.py --rounds 1 --no-write

The table is printed and, unless ``--no-write``, written into ``--out`` between
``<!-- keras_mimo:begin -->`` and ``<!-- keras_mimo:end -->``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import lockstep
import report

BEGIN = "<!-- keras_mimo:begin -->"
END = "<!-- keras_mimo:end -->"
HEADING, ANCHOR = next(s for s in report.SECTIONS if s[0].endswith("(`keras_mimo`)"))
SYSTEMS = ("keras", "AllReduce", "AllReduce, 1 replica", "MirroredStrategy")
GOAL_RATIO = 1.3
WORDS, TAGS, DEPARTMENTS = 10000, 12, 4
TITLE_WORDS, BODY_WORDS = 10, 100
ROWS, BATCH = 1280, 32


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


def run_worker(system: str, epochs: int) -> None:
    """Builds and fits the model under ``system`` in this process, one batch per
    ``go`` line read from stdin; writes each batch's seconds to stdout."""
    import tensorflow as tf

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
    inputs, targets = _data()
    lockstep.time_steps(model)
    model.fit(inputs, targets, epochs=epochs, batch_size=BATCH, verbose=0)
    lockstep.finished()


def run_round(args) -> dict:
    """One lockstep run of fresh processes (``lockstep.run_round``): system -> its steps'
    seconds (None when its process failed), the steps of one cycle at one index."""
    script = os.path.abspath(__file__)
    return lockstep.run_round(
        {system: [sys.executable, script, "--job", system, "--epochs", str(args.epochs)]
         for system in args.systems}, args.timeout)


def measure(args) -> list:
    """Per round, (system -> its median step or None, the median per-cycle ratio of
    AutoDist's two replicas over plain Keras, or None)."""
    rounds = []
    for round_index in range(args.rounds):
        steps = run_round(args)
        medians = {system: statistics.median(times[args.warmup:]) if times else None
                   for system, times in steps.items()}
        ratio = lockstep.cycle_ratio(steps.get("AllReduce"), steps.get("keras"), args.warmup)
        rounds.append((medians, ratio))
        shown = ", ".join(f"{system} {_ms(step)} ms" for system, step in medians.items())
        print(f"round {round_index + 1}: {shown}; two replicas / keras per cycle "
              f"{'n/a' if ratio is None else f'{ratio:.2f}'}", flush=True)
    return rounds


def summarize(rounds: list) -> dict:
    """System -> (median step over the rounds, or None, failed rounds)."""
    out = {}
    for system in rounds[0][0]:
        good = [medians[system] for medians, _ in rounds if medians[system] is not None]
        out[system] = (statistics.median(good) if good else None, len(rounds) - len(good))
    return out


def _ms(value) -> str:
    return "failed" if value is None else f"{value * 1e3:.1f}"


def format_markdown(table: dict, ratios: list, args, command: str) -> str:
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
        f"{info['tf']}, Python {info['python']}; each system's default thread pools "
        "(AutoDist's two CPU replicas: an intra-op pool each, of half the cores). Each "
        "system in a process of its own, the processes one step each in turn (lockstep), "
        "timing `train_function` (no callback); "
        f"{args.rounds} rounds of fresh processes, each system's figure the median of its "
        f"steps after {args.warmup} warm-up steps, then the median over the rounds; 1-minute "
        f"load {info['load']} at the end.", "",
        f"Command: `{command}`", "",
        "| system | median step ms | vs plain Keras (ratio of the medians) | failed rounds |",
        "|---|--:|--:|--:|"]
    for system, (step, failed) in table.items():
        ratio = f"{step / reference:.2f}x" if step and reference else "n/a"
        lines.append(f"| {system} | {_ms(step)} | {ratio} | {failed} |")
    lines += ["", "Findings:", ""]
    two = table.get("AllReduce", (None, 0))[0]
    if ratios:
        ratio = statistics.median(ratios)
        verdict = "met" if ratio <= GOAL_RATIO else "**not met**"
        lines.append(f"- AutoDist, two replicas, against plain Keras in the same cycle: "
                     f"{ratio:.2f}x (median over the rounds; rounds: "
                     + ", ".join(f"{r:.2f}x" for r in ratios)
                     + f"); goal <= {GOAL_RATIO}x {verdict}. The ratio of the two medians, "
                     "from steps of different cycles, is the table's.")
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
    parser.add_argument("--rounds", type=int, default=3,
                        help="lockstep runs of fresh processes (default: 3)")
    parser.add_argument("--epochs", type=int, default=4, help="epochs per job (default: 4)")
    parser.add_argument("--warmup", type=int, default=45,
                        help="untimed batches first (default: 45)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds a process may take for one step (default: 300)")
    parser.add_argument("--out", default=os.path.join(report.REPO, "docs", "benchmarks.md"),
                        help="markdown file whose keras_mimo section is rewritten")
    parser.add_argument("--no-write", action="store_true", help="only print the table")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job:
        if report.REPO not in sys.path:
            sys.path.insert(0, report.REPO)
        run_worker(args.job, args.epochs)
        return 0
    if args.warmup >= args.epochs * ROWS // BATCH:
        parser.error(f"--warmup {args.warmup} leaves no step of {args.epochs} epochs of "
                     f"{ROWS // BATCH} batches to time")
    rounds = measure(args)
    table = summarize(rounds)
    ratios = [ratio for _, ratio in rounds if ratio is not None]
    for system, (step, failed) in table.items():
        print(f"{system}: {_ms(step)} ms per step ({failed} failed rounds)")
    if ratios:
        print("two replicas / keras per cycle, per round: "
              + " ".join(f"{r:.2f}" for r in ratios))
    if not args.no_write:
        command = report.command_line("benchmarks/keras_mimo.py", parser, args)
        markdown = format_markdown(table, ratios, args, command)
        report.write_section(args.out, markdown, BEGIN, END)
        report.add_contents_entry(args.out, HEADING, ANCHOR)
        print(f"wrote the keras_mimo section of {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
