"""What the benchmark scripts share: the machine they ran on, and their section of the docs.

Each script owns one section of docs/benchmarks.md between its begin/end markers
and rewrites only that, so the scripts can run in any order.
"""
from __future__ import annotations

import argparse
import ast
import datetime
import os
import platform
import shlex
import sys
import tempfile
from importlib import metadata

# Sections in the order they appear, each as (heading, GitHub's anchor of it): the
# page's table of contents. A script whose markers are absent appends its section.
# Every benchmark job's thread pools, the same for all systems measured, set before
# TensorFlow loads; an explicit setting in the environment wins.
JOB_ENV = {
    "AUTODIST_INTRA_OP_THREADS": "1",
    "AUTODIST_INTER_OP_THREADS": "2",
    "TF_CPP_MIN_LOG_LEVEL": "2",
}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_replica_spec() -> str:
    """A resource spec file (in a new temporary directory): this machine, one CPU replica."""
    path = os.path.join(tempfile.mkdtemp(prefix="autodist_bench."), "one_replica.yml")
    with open(path, "w", encoding="utf-8") as f:
        f.write("nodes:\n  - address: localhost\n    cpus: [0]\n    chief: true\n")
    return path


def use_job_environment() -> None:
    """Sets ``JOB_ENV`` (unless set) and puts the repository on ``sys.path``."""
    os.environ.update({k: os.environ.get(k, v) for k, v in JOB_ENV.items()})
    if REPO not in sys.path:
        sys.path.insert(0, REPO)


SECTIONS = (
    ("Graph-rewrite time vs. model size and replicas (`transform_scale`)",
     "graph-rewrite-time-vs-model-size-and-replicas-transform_scale"),
    ("Step time vs. the ring all-reduce bound (`step_time`)",
     "step-time-vs-the-ring-all-reduce-bound-step_time"),
    ("AutoStrategy vs. the hand-written builders (`auto_vs_builders`)",
     "autostrategy-vs-the-hand-written-builders-auto_vs_builders"),
    ("Sampling and scoring AutoStrategy's candidates (`sampling_speed`)",
     "sampling-and-scoring-autostrategys-candidates-sampling_speed"),
    ("Keras fit step time vs tf.distribute (`keras_step_time`)",
     "keras-fit-step-time-vs-tfdistribute-keras_step_time"),
    ("Sharded update vs. AllReduce with Adam (`sharded_update`)",
     "sharded-update-vs-allreduce-with-adam-sharded_update"),
    ("Gradient accumulation on 4 nodes (`accumulation`)",
     "gradient-accumulation-on-4-nodes-accumulation"),
    ("AutoDist vs. Horovod and MultiWorkerMirroredStrategy (`peers`)",
     "autodist-vs-horovod-and-multiworkermirroredstrategy-peers"),
    ("Communication overlapping the backward pass (`overlap`)",
     "communication-overlapping-the-backward-pass-overlap"),
    ("Start-up and memory vs. the model's bytes (`model_scale`)",
     "start-up-and-memory-vs-the-models-bytes-model_scale"),
    ("Embedding tables: step time and memory by table size (`embeddings`)",
     "embedding-tables-step-time-and-memory-by-table-size-embeddings"),
    ("Embedding tables: a DLRM-style model (`embeddings --model dlrm`)",
     "embedding-tables-a-dlrm-style-model-embeddings---model-dlrm"),
    ("A table larger than one node (`table_over_node`)",
     "a-table-larger-than-one-node-table_over_node"),
    ("Multi-input multi-output Keras model: step time (`keras_mimo`)",
     "multi-input-multi-output-keras-model-step-time-keras_mimo"),
    ("Small models: AutoDist's fixed cost per step (`keras_library_step`)",
     "small-models-autodists-fixed-cost-per-step-keras_library_step"),
)

HEADER = "\n".join([
    "# Benchmarks", "",
    "What AutoDist costs (rewriting the graph, sampling strategies) and what it gains (step "
    "time against the network's bound and against tf.distribute, AutoStrategy against the "
    "hand-written builders), measured on 2-core machines with emulated clusters standing in "
    "for real networks.", "",
    "Each section gives what it measures, its goal and whether it holds, when and on what it "
    "ran, the command that reproduces it, its table(s) and a few findings; the longer "
    "investigations behind the figures are in `docs/notes/`, linked from each section. Each "
    "script in `benchmarks/` rewrites only its own section.", "",
    "**Contents**", "",
    *[f"- [{heading}](#{anchor})" for heading, anchor in SECTIONS], ""])



def parse_builder(text: str, extra_names: tuple = ()) -> tuple[str, dict]:
    """``"AllReduce:chunk_size=1,compressor=HorovodCompressor"`` -> (name, kwargs).

    Values are Python literals; a bare word is a string.

    Args:
        extra_names: names a script accepts besides the registered builders.

    Raises:
        ValueError: for an unknown builder name or a malformed argument.
    """
    from autodist.strategy import BUILDERS
    name, _, rest = text.partition(":")
    if name not in BUILDERS and name not in extra_names:
        raise ValueError(f"Unknown builder {name!r} in {text!r}; valid names are "
                         f"{sorted(BUILDERS) + list(extra_names)}.")
    kwargs = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"Builder argument {item!r} in {text!r} is not key=value.")
        try:
            kwargs[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            kwargs[key.strip()] = value.strip()  # a bare word: a string
    return name, kwargs


def machine_info() -> dict:
    """Date, cores, CPU model, TensorFlow and Python versions, 1-minute load average."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"date": datetime.date.today().isoformat(), "cores": os.cpu_count(), "cpu": cpu,
            "tf": metadata.version("tensorflow"), "python": platform.python_version(),
            "load": "%.1f" % os.getloadavg()[0]}


def command_line(script: str, parser: argparse.ArgumentParser, args: argparse.Namespace,
                 skip: tuple = ("out", "no_write")) -> str:
    """The command that reruns ``script`` (a path from the repository's root) with ``args``:
    the options whose values differ from ``parser``'s defaults, in the parser's order.

    Hidden options and those named in ``skip`` (by ``dest``) are left out.
    """
    words = ["python", script]
    for action in parser._actions:  # pylint: disable=protected-access
        if (not action.option_strings or action.help == argparse.SUPPRESS
                or action.dest in skip or action.dest == "help"):
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = next((o for o in action.option_strings if o.startswith("--")),
                    action.option_strings[0])
        if action.nargs == 0:
            words.append(flag)
        elif isinstance(value, (list, tuple)):
            words += [flag, *(shlex.quote(str(v)) for v in value)]
        else:
            words += [flag, shlex.quote(str(value))]
    return " ".join(words)


def write_section(path: str, section: str, begin: str, end: str) -> None:
    """Replaces (or appends) the ``begin``..``end`` section of ``path``.

    The file is re-read just before and replaced atomically, so another script's
    section written meanwhile survives.
    """
    text = _read_page(path)
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = (text or HEADER).rstrip("\n") + "\n\n" + section + "\n"
    _replace_page(path, text)


def add_contents_entry(path: str, heading: str, anchor: str) -> bool:
    """Adds ``- [heading](#anchor)`` after the last entry of the contents of ``path``
    (the list items before its first ``## `` section) unless an entry links ``#anchor``;
    returns whether it did. Re-read and replaced as by :func:`write_section`."""
    text = _read_page(path)
    head, _, _ = text.partition("\n## ")
    if f"](#{anchor})" in head:
        return False
    lines = text.split("\n")
    items = [i for i, line in enumerate(lines[:head.count("\n") + 1]) if line.startswith("- [")]
    if not items:
        raise ValueError(f"{path} has no table of contents (a list of links before its first "
                         f"'## ' section) to add {anchor!r} to.")
    lines.insert(items[-1] + 1, f"- [{heading}](#{anchor})")
    _replace_page(path, "\n".join(lines))
    return True


def _read_page(path: str) -> str:
    if not os.path.exists(path):
        return ""
    with open(path, encoding="utf-8") as f:
        return f.read()


def _replace_page(path: str, text: str) -> None:
    """Writes ``text`` to ``path`` through a temporary file renamed over it."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".benchmarks.", suffix=".md")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
