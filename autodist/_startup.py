"""What must be set before TensorFlow creates its devices: its C++ start-up logs
kept out of the user's way, and a thread pool of each device's own.

TensorFlow's native libraries log while they load and while the devices are
first listed (oneDNN notices, missing CUDA drivers, CPU features), before
``TF_CPP_MIN_LOG_LEVEL`` is consulted. Once ``autodist`` is imported, the first
import of TensorFlow (and of Keras) runs with the process's standard error
captured: the lines of TensorFlow's C++ logging are dropped, anything else is
passed on; later C++ logs are left to ``TF_CPP_MIN_LOG_LEVEL``, 3 unless set.
``AUTODIST_TF_LOGS=1`` keeps every line and TensorFlow's own log level.

``install()`` is the one place this process-wide import hook is installed; it
removes itself once both modules are loaded.

``own_thread_pools()`` gives every CPU device TensorFlow creates its own
intra-op pool, sized by the config of the session or server that creates it.
By default the first device made in the process (the eager context's, at the
first eager op) creates one pool that every later device shares, whatever a
session's ``intra_op_parallelism_threads`` says: two CPU replicas then split
each small product over the same threads and wait on each other.
TensorFlow reads the switch once, when it creates its first device, so it
takes effect only if ``autodist`` is imported before the first eager op.
"""
from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import os
import re
import sys
import tempfile
from typing import Iterator

LOGS_ENV = "AUTODIST_TF_LOGS"
# TensorFlow's switch (read by LocalDevice) from one shared intra-op pool to a pool per device.
OWN_POOLS_ENV = "TF_OVERRIDE_GLOBAL_THREADPOOL"
_QUIETED = ("tensorflow", "keras")
# absl's notice, a C++ log line ("I0000 00:00:1795.. 2429 port.cc:153] ..."), and
# the second line of the CPU-features notice.
_CPP_LOG = re.compile(r"^(WARNING: All log messages before absl::InitializeLog\(\)"
                      r"|[IWEF]\d{4} [\d:.]+ +\d+ [\w./-]+:\d+\]"
                      r"|To enable the following instructions:)")


def is_cpp_log_line(line: str) -> bool:
    """Whether ``line`` is one of TensorFlow's C++ log lines."""
    return bool(_CPP_LOG.match(line))


def install() -> None:
    """Quiets the first import of TensorFlow and Keras, unless ``AUTODIST_TF_LOGS=1``.

    Raises:
        ValueError: when ``AUTODIST_TF_LOGS`` is set to anything but 0 or 1.
    """
    logs = os.environ.get(LOGS_ENV, "").strip()
    if logs not in ("", "0", "1"):
        raise ValueError(f"{LOGS_ENV}={logs[:40]!r} is neither 0 nor 1: set it to 1 to keep "
                         "TensorFlow's start-up logs, or unset it.")
    if logs == "1":
        return
    # 3: oneDNN logs notices as errors at run time; TensorFlow's real errors
    # reach the user as Python exceptions.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    pending = [name for name in _QUIETED if name not in sys.modules]
    if pending and not any(isinstance(f, _QuietFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _QuietFinder(pending))


def own_thread_pools() -> None:
    """Gives each CPU device made from now on an intra-op pool of its own, unless the
    user set ``TF_OVERRIDE_GLOBAL_THREADPOOL`` (to 0: one shared pool, as TensorFlow's
    default)."""
    os.environ.setdefault(OWN_POOLS_ENV, "1")


@contextlib.contextmanager
def _cpp_logs_dropped() -> Iterator[None]:
    """Captures file descriptor 2; on exit passes on every line but C++ log lines."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        failed = True
        try:
            yield
            failed = False
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode(errors="replace")
            kept = [line for line in text.splitlines(keepends=True)
                    if failed or not is_cpp_log_line(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


class _QuietLoader(importlib.abc.Loader):
    """Runs another loader's module with the C++ start-up logs dropped."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        with _cpp_logs_dropped():
            self._loader.exec_module(module)
            if module.__name__ == "tensorflow":
                module.config.list_physical_devices()  # the devices' own start-up logs


class _QuietFinder(importlib.abc.MetaPathFinder):
    """Finds ``tensorflow`` and ``keras`` as usual, with a quiet loader."""

    def __init__(self, names: list):
        self._names = set(names)

    def find_spec(self, name, path, target=None):
        if name not in self._names:
            return None
        self._names.discard(name)
        if not self._names:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _QuietLoader(spec.loader)
        return spec
