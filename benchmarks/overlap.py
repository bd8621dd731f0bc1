"""Does the all-reduce overlap the backward pass? A CNN's step against its compute and traffic.

The model: a CNN on 32 x 32 x 3 inputs, three 3 x 3 convolutions (64, 128, 256
filters, ReLU; max-pooling after the second and third), a dense layer of 256
(ReLU) and 10 logits: 2.7 M float32 weights, 10.9 MB, of which the first
dense kernel holds 9.4 MB. SGD (learning rate 0.01), sparse cross-entropy from
logits, 32 rows per replica per step, trained with Keras ``fit`` on synthetic
data. The cluster: 2 emulated nodes (``autodist emulate``), links shaped to
``--bandwidth`` each way, one CPU replica and one process per node.

The backward pass computes the dense layers' gradients first and the
convolutions' last, and the convolutions are most of the compute. The
builder's buckets (``--builder``, default ``AllReduce``: 8 MiB buckets in
backward order) put the dense kernel in a bucket of its own, so its reduction
can travel while the convolutions' gradients are computed.

Systems, each a fresh job, rounds interleaved:

* ``compute``: the CNN on one node, one replica: the step without communication;
* ``communication``: on the cluster under the builder, a stand-in model with
  variables of the CNN's shapes whose gradients cost one fill each: the step
  without compute;
* ``overlapped``: the CNN on the cluster under the builder;
* ``one bucket``: the same with ``bucket_bytes=None``: one bucket, which can
  only start once the whole backward pass is done.

Every process runs with 1 intra-op and 2 inter-op threads (``report.JOB_ENV``),
and each node's processes on a core of their own (``taskset``; ``compute`` on
the first node's): the emulated nodes share the machine's cores, and a node
computing alone must not borrow the other's.
A job times each batch after the warm-up ones (``keras_step_time``'s timer) and
reports the median; a system's figure is the median over rounds.

Goal (from the issue): ``overlapped`` is below ``compute`` + ``communication``.
*Hidden* = compute + communication - overlapped: the time the overlap saves.

Usage (root, iproute2):
    python benchmarks/overlap.py                          # 3 rounds, writes docs
    python benchmarks/overlap.py --rounds 1 --timed 5 --no-write

The table is printed and, unless ``--no-write``, written into ``--out`` between
``<!-- overlap:begin -->`` and ``<!-- overlap:end -->``. The emulated cluster is
always removed, even after an error.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import report

report.use_job_environment()  # before TensorFlow loads
import keras_step_time as kst  # noqa: E402  (needs the job environment)

REPO = report.REPO
BEGIN = "<!-- overlap:begin -->"
END = "<!-- overlap:end -->"
TITLE = "Communication overlapping the backward pass (`overlap`)"
CLUSTER_NAME = "adov"
NUM_NODES = 2
ROWS_PER_REPLICA = 32
IMAGE = (32, 32, 3)
FILTERS = (64, 128, 256)
DENSE = 256
CLASSES = 10
COMPUTE, COMMUNICATION, OVERLAPPED, ONE_BUCKET = ("compute", "communication", "overlapped",
                                                  "one bucket")
SYSTEMS = (COMPUTE, COMMUNICATION, OVERLAPPED, ONE_BUCKET)


# --------------------------------------------------------------------------- the jobs

def _cnn():
    """The CNN, compiled with SGD and a cross-entropy from logits (call inside a scope)."""
    import keras
    layers = [keras.Input(IMAGE)]
    for i, filters in enumerate(FILTERS):
        layers.append(keras.layers.Conv2D(filters, 3, activation="relu"))
        if i:
            layers.append(keras.layers.MaxPooling2D())
    layers += [keras.layers.Flatten(), keras.layers.Dense(DENSE, activation="relu"),
               keras.layers.Dense(CLASSES)]
    return kst.compiled(keras.Sequential(layers))


def _stand_in(shapes: list):
    """A model with variables of ``shapes`` and next to no compute.

    Its logits add ``1e-6 *`` the sum of every variable to zeros, so each
    variable's gradient is one fill of its shape, and the step is the
    synchronization of gradients of the CNN's sizes.
    """
    import keras

    class Weights(keras.layers.Layer):
        def build(self, input_shape):
            self.tensors = [self.add_weight(shape=s, initializer="zeros") for s in shapes]

        def call(self, x):
            total = sum(keras.ops.sum(w) for w in self.tensors)
            return keras.ops.zeros_like(x[:, :CLASSES]) + 1e-6 * total

    return kst.compiled(keras.Sequential([keras.Input((CLASSES,)), Weights()]))


def _cnn_shapes() -> list:
    return [tuple(w.shape) for w in _cnn().weights]


def _data(seed: int, rows: int, stand_in: bool):
    import numpy as np
    rng = np.random.RandomState(seed)
    shape = (CLASSES,) if stand_in else IMAGE
    return (rng.rand(rows, *shape).astype(np.float32),
            rng.randint(0, CLASSES, size=rows).astype(np.int32))


def job(spec: str, builder: str, stand_in: bool, warmup: int, timed: int) -> None:
    """One node's part of a run (the chief launches the others); the chief prints the result."""
    kst.limit_threads()
    import keras

    from autodist import AutoDist
    from autodist.strategy import get_builder

    name, kwargs = report.parse_builder(builder)
    ad = AutoDist(resource_spec_file=spec, strategy_builder=get_builder(name, **kwargs))
    x, y = _data(ad.node_index, ROWS_PER_REPLICA * (warmup + timed), stand_in)
    keras.utils.set_random_seed(0)
    shapes = _cnn_shapes() if stand_in else None  # outside the scope: not trained
    with ad.scope():
        model = _stand_in(shapes) if stand_in else _cnn()
    timer = kst.batch_timer(warmup)
    model.fit(x, y, batch_size=ROWS_PER_REPLICA, epochs=1, verbose=0, shuffle=False,
              callbacks=[timer])
    kst.print_cpu(builder, ad.node_index, timer)
    if ad.is_chief:
        kst.print_result(builder, timer)


# --------------------------------------------------------------------------- the driver

def _one_bucket(builder: str) -> str:
    """``builder`` with every all-reduced gradient in one bucket."""
    return builder + ("," if ":" in builder else ":") + "bucket_bytes=None"


def _pinned(node: int) -> list:
    """The words that run a command of emulated node ``node`` on a core of its own.

    The emulated nodes share the machine's cores; pinned, each has one, as a
    node of a real cluster has its own, and its compute cannot borrow another
    node's core. So compute measured alone is what it is on the cluster.
    """
    return ["taskset", "-c", str(node % os.cpu_count())]


def _job_argv(spec: str, builder: str, stand_in: bool, args) -> list:
    return ([sys.executable, os.path.abspath(__file__), "--_job", "--spec", spec,
             "--builder", builder, "--warmup", str(args.warmup), "--timed", str(args.timed)]
            + (["--_stand-in"] if stand_in else []))


def measure(args) -> dict:
    """Runs ``args.rounds`` interleaved rounds of every system; system -> list of job rows."""
    import yaml

    from autodist.cluster import emulate
    emulate.down(CLUSTER_NAME)  # one left behind by an interrupted run of this script
    with tempfile.TemporaryDirectory() as tmp, emulate.emulated_cluster(
            NUM_NODES, args.bandwidth, name=CLUSTER_NAME,
            cpus_per_node=[1] * NUM_NODES) as cluster:
        one_node, spec = os.path.join(tmp, "one_node.yml"), os.path.join(tmp, "cluster.yml")
        with open(one_node, "w", encoding="utf-8") as f:
            yaml.safe_dump({"nodes": [{"address": "localhost", "cpus": [0], "chief": True}]}, f)
        nodes = emulate.spec_dict(cluster)
        for i, node in enumerate(nodes["nodes"]):
            node["launch_prefix"] = node["launch_prefix"] + _pinned(i)
        with open(spec, "w", encoding="utf-8") as f:
            yaml.safe_dump(nodes, f)
        chief = nodes["nodes"][0]["launch_prefix"]

        def run(system: str) -> dict:
            if system == COMPUTE:
                argv = _pinned(0) + _job_argv(one_node, args.builder, False, args)
            else:
                builder = _one_bucket(args.builder) if system == ONE_BUCKET else args.builder
                argv = chief + _job_argv(spec, builder, system == COMMUNICATION, args)
            return kst.job_result(system, kst.collect([kst.start_job(argv, kst.job_env())],
                                                      args.timeout))

        return kst.run_rounds("overlap", list(SYSTEMS), run, args.rounds, rotate=True)


# --------------------------------------------------------------------------- the report

def summarize(results: dict) -> dict:
    """system -> {median_s, cpu_s, rounds, errors}, plus the derived "sum" and "hidden" figures."""
    rows = {}
    for system, runs in results.items():
        medians = [r["median_s"] for r in runs if "median_s" in r]
        cpus = [statistics.mean(r["cpu_s_per_step"]) for r in runs if r.get("cpu_s_per_step")]
        rows[system] = {"rounds": medians, "errors": [r["error"] for r in runs if "error" in r],
                        "median_s": statistics.median(medians) if medians else None,
                        "cpu_s": statistics.median(cpus) if cpus else None}
    compute, communication = rows[COMPUTE]["median_s"], rows[COMMUNICATION]["median_s"]
    alone = compute + communication if compute and communication else None
    for system in (OVERLAPPED, ONE_BUCKET):
        step = rows[system]["median_s"]
        rows[system]["hidden_s"] = alone - step if alone and step else None
    return {"rows": rows, "alone_s": alone}


def _ms(value) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def _table(summary: dict) -> list:
    """Markdown table lines, one row per system."""
    lines = ["| system | step (ms) | rounds (ms) | CPU s / step / process | hidden (ms) |",
             "|---|--:|--:|--:|--:|"]
    for system, row in summary["rows"].items():
        rounds = " / ".join(_ms(v) for v in row["rounds"]) or "failed: " + row["errors"][0]
        cpu = "-" if row["cpu_s"] is None else f"{row['cpu_s']:.3f}"
        lines.append(f"| {system} | {_ms(row['median_s'])} | {rounds} | {cpu} | "
                     f"{_ms(row.get('hidden_s')) if system in (OVERLAPPED, ONE_BUCKET) else ''} |")
    return lines


def verdict(summary: dict):
    """(met: True/False/None, one sentence) for the goal: overlapped < compute + communication."""
    step, alone = summary["rows"][OVERLAPPED]["median_s"], summary["alone_s"]
    if step is None or alone is None:
        return None, "Overlap: not measured (a system failed)."
    met = step < alone
    return met, (f"`overlapped` {_ms(step)} ms against compute + communication {_ms(alone)} ms: "
                 f"{_ms(alone - step)} ms hidden; goal (below the sum) "
                 f"{'**met**' if met else '**not met**'}.")


def format_section(summary: dict, args, command: str, info: dict, elapsed: float) -> str:
    rows = summary["rows"]
    one_bucket = rows[ONE_BUCKET]["median_s"]
    overlapped = rows[OVERLAPPED]["median_s"]
    lines = [BEGIN, f"## {TITLE}", "",
             f"A CNN ({' / '.join(map(str, FILTERS))}-filter convolutions, dense {DENSE}, "
             f"{CLASSES} logits; 10.9 MB of float32 weights, 9.4 MB of them in the first dense "
             f"kernel) at {ROWS_PER_REPLICA} rows per replica on {NUM_NODES} emulated nodes, "
             f"links at {args.bandwidth}, under `{args.builder}`. Goal: its step is shorter than "
             "its compute and its communication, each measured alone.", "",
             "- *compute*: the step on one replica, with no communication;",
             "- *communication*: the step of a stand-in model with the CNN's variable shapes "
             "and next to no compute;",
             "- *overlapped*: the CNN's step on the cluster;",
             "- *one bucket*: the same with `bucket_bytes=None`, so the reduction starts after "
             "the whole backward pass;",
             "- *hidden* = compute + communication - step.",
             "", f"Command: `{command}`", "",
             f"Measured {info['date']} on {info['cores']} cores ({info['cpu']}), TensorFlow "
             f"{info['tf']}, Python {info['python']}; median of {args.rounds} interleaved rounds, "
             f"each job {args.warmup} warm-up + {args.timed} timed batches, 1 intra-op / 2 "
             "inter-op threads per process, each node's processes pinned to a core of its own "
             "(`taskset`), as a node of a real cluster has its own; 1-minute load average "
             f"{info['load']} at the end; the run took {elapsed / 60:.0f} min.", "",
             *_table(summary), "",
             f"- {verdict(summary)[1]}"]
    if one_bucket and overlapped:
        lines.append(f"- One bucket: {_ms(one_bucket)} ms, {one_bucket / overlapped:.2f}x the "
                     "bucketed step: buckets in backward order are what let the reduction "
                     "start early.")
    return "\n".join(lines + [END])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--builder", default="AllReduce",
                        help="the AutoDist builder, as name:key=value,... (default: AllReduce)")
    parser.add_argument("--bandwidth", default="1gbit",
                        help="every link's rate, as tc writes it (default: 1gbit)")
    kst.add_job_args(parser)
    parser.add_argument("--out", default=os.path.join(REPO, "docs", "benchmarks.md"),
                        help="markdown file whose overlap section is rewritten")
    parser.add_argument("--no-write", action="store_true", help="only print the table")
    parser.add_argument("--_job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--_stand-in", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    # pylint: disable=protected-access
    if args._job:
        job(args.spec, args.builder, args._stand_in, args.warmup, args.timed)
        return 0
    try:
        report.parse_builder(args.builder)
    except ValueError as e:
        parser.error(str(e))
    kst.check_job_args(parser, args)
    start = time.perf_counter()
    summary = summarize(measure(args))
    elapsed = time.perf_counter() - start
    info = report.machine_info()
    print("\n".join(_table(summary)))
    met, sentence = verdict(summary)
    print(sentence.replace("**", ""))
    if not args.no_write:
        command = report.command_line("benchmarks/overlap.py", parser, args)
        report.write_section(args.out, format_section(summary, args, command, info, elapsed),
                             BEGIN, END)
        print(f"wrote the overlap section of {args.out}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
