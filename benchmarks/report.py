"""What the benchmark scripts share: the machine they ran on, and their section of the docs.

Each script owns one section of docs/benchmarks.md between its begin/end markers
and rewrites only that, so the scripts can run in any order.
"""
from __future__ import annotations

import datetime
import os
import platform
import tempfile
from importlib import metadata

HEADER = ("# Benchmarks\n\nResults of the scripts in `benchmarks/`; each script "
          "rewrites only its own section.\n")


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


def write_section(path: str, section: str, begin: str, end: str) -> None:
    """Replaces (or appends) the ``begin``..``end`` section of ``path``.

    The file is re-read just before and replaced atomically, so another script's
    section written meanwhile survives.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    text = ""
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            text = f.read()
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = (text or HEADER).rstrip("\n") + "\n\n" + section + "\n"
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
