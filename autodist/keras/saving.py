"""Keras saves that a stop cannot cut, written by one node.

``model.save`` and ``model.save_weights`` of a model compiled inside
``ad.scope()`` (and so ``ModelCheckpoint``, which calls them):

* write a temporary file beside the target, named after the target, the host
  and the process, and rename it over the target once it is complete. A
  process killed in the middle (SIGKILL, a lost machine) leaves the previous
  file whole, and the next save of the target removes that process's temporary
  file;
* hold SIGTERM and SIGINT while they run: the save finishes first, within
  ``AUTODIST_SAVE_GRACE_S`` seconds (20 by default) of the signal, and the
  signal then acts as it would have (the chief stops its job, Ctrl-C raises
  ``KeyboardInterrupt``). A second signal, or the bound running out, stops the
  process without the save, keeping the previous file;
* write a weight or optimizer slot that AutoDist keeps in parts and the model
  holds no value of (a large table, see ``DeferredVariable``) piece by piece,
  fetching one piece of a part at a time, so the chief never holds it whole;
* on a cluster, are the chief's alone: a worker's call writes nothing and says
  so once. Every node holds the same weights, only the chief holds the whole
  optimizer state (a parameter server's slots among it), and nodes sharing a
  file system would otherwise write one path together.

Saves that write several files (sharded weights, an unzipped model) or go
elsewhere than a local path skip the rename (the rest holds).
"""
from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import socket
import sys
import threading
from typing import Callable, Iterator

import keras

from autodist import _keras_compat

SAVE_GRACE_ENV = "AUTODIST_SAVE_GRACE_S"
DEFAULT_SAVE_GRACE_S = 20.0  # within the 30 s Slurm and Kubernetes allow before SIGKILL
MAX_SAVE_GRACE_S = 86400.0  # a thread's wait refuses timeouts past 2^63 ns, "inf" among them
_EXIT_IF_STUCK_S = 5.0  # after the bound, the main thread's handler gets this long to act
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_SUFFIXES = (".weights.h5", ".keras", ".h5")


def guard_saves(model: keras.Model, writes: bool = True) -> None:
    """Makes ``model.save`` and ``model.save_weights`` safe to stop (see the module).

    Args:
        model: the model compiled in ``ad.scope()``.
        writes: whether this node writes saves: the chief of a cluster, or the
            only node; a worker's saves write nothing.
    """
    cls = type(model)
    guard = _saved_aside if writes else functools.partial(_left_to_chief, set())
    # Instance attributes: only this model changes, and Python looks them up first.
    model.save = functools.partial(guard, functools.partial(cls.save, model))
    model.save_weights = functools.partial(guard, functools.partial(cls.save_weights, model))


def temporary_path(filepath: str) -> str:
    """Where a save of ``filepath`` writes before the rename: beside it, hidden, named
    after it, this host and this process, with its suffix (which Keras checks)."""
    directory, head, suffix = _temporary_parts(filepath)
    return os.path.join(directory, f"{head}{os.getpid()}{suffix}")


def remove_stale_temporaries(filepath: str) -> list:
    """Removes what saves of ``filepath`` by this host's processes that are gone left
    (killed in the middle, so never renamed); returns the paths removed.

    Another host's leftovers on a shared file system stay: whether their process
    still writes cannot be told from here.
    """
    directory, head, suffix = _temporary_parts(filepath)
    pattern = re.compile(re.escape(head) + r"(\d+)" + re.escape(suffix))
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(directory):
            match = pattern.fullmatch(name)
            if match and not _is_running(int(match.group(1))):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(directory, name))
                    removed.append(os.path.join(directory, name))
    return removed


def _temporary_parts(filepath: str) -> tuple:
    """(directory, name up to the process id, suffix) of ``temporary_path(filepath)``."""
    directory, name = os.path.split(os.path.abspath(filepath))
    suffix = next(s for s in _SUFFIXES if name.endswith(s))
    return directory, f".{name[:-len(suffix)]}.autodist-{socket.gethostname()}-", suffix


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def save_grace() -> float:
    """Seconds a save may go on after a stop signal (``AUTODIST_SAVE_GRACE_S``).

    Raises:
        ValueError: when the variable is set to something else than a number of
            seconds from 0 to ``MAX_SAVE_GRACE_S``.
    """
    text = os.environ.get(SAVE_GRACE_ENV, "").strip()
    if not text:
        return DEFAULT_SAVE_GRACE_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= MAX_SAVE_GRACE_S:
        raise ValueError(f"{SAVE_GRACE_ENV}={text!r} is not a number of seconds from 0 to "
                         f"{MAX_SAVE_GRACE_S:g}: a stop waits for a save at most a day.")
    return seconds


def _saved_aside(save: Callable, filepath, *args, **kwargs):
    path = os.fspath(filepath) if isinstance(filepath, (str, os.PathLike)) else None
    overwrite = kwargs.get("overwrite", args[0] if args else True)
    whole_file = (path is not None and "://" not in path and path.endswith(_SUFFIXES)
                  and not kwargs.get("max_shard_size") and kwargs.get("zipped") is not False)
    if not whole_file or (not overwrite and os.path.exists(path)):
        with _stops_held(str(filepath)), _keras_compat.deferred_variables_saved_in_pieces():
            return save(filepath, *args, **kwargs)  # Keras's own behaviour (and its prompt)
    temporary = temporary_path(path)

    def abandon() -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)

    try:
        with _stops_held(path, abandon), _keras_compat.deferred_variables_saved_in_pieces():
            result = save(temporary, *args, **kwargs)
            os.replace(temporary, path)
        remove_stale_temporaries(path)
        return result
    finally:
        abandon()


def _left_to_chief(told: set, save: Callable, filepath, *args, **kwargs) -> None:
    """A worker's save: says once per target that the chief writes it."""
    what = f"{save.func.__name__}({str(filepath)!r})"
    if what not in told:
        told.add(what)
        sys.stderr.write(
            f"AutoDist worker: model.{what} writes nothing on this node: on a cluster the "
            "chief writes Keras saves (every node holds the same weights; the chief holds the "
            "whole optimizer state).\n")


@contextlib.contextmanager
def _stops_held(target: str, abandon: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Holds SIGTERM and SIGINT until the body ends, at most ``save_grace()`` s after
    the first of them; then acts on it as the handler found here would have.

    ``abandon`` removes what the save wrote so far, when a stop cannot wait for it.
    """
    if (threading.current_thread() is not threading.main_thread()
            or getattr(signal.getsignal(signal.SIGTERM), "holds_stops", False)):
        yield  # handlers are the main thread's; an outer save holds them already
        return
    bound = save_grace()
    # A handler set outside Python (None) could not be put back: such signals act at once.
    previous = {signum: handler for signum in _STOP_SIGNALS
                if (handler := signal.getsignal(signum)) is not None}
    held = []  # the signal received, once one is
    finished = threading.Event()

    def hold(signum, frame):
        if held:  # a second signal, or the bound ran out: stop now
            abandon()  # the process may end here, without unwinding the save
            signal.signal(held[0], previous[held[0]])
            _act_on(held[0], previous[held[0]], frame)
            return
        held.append(signum)
        sys.stderr.write(f"AutoDist: {signal.Signals(signum).name} arrived during the save of "
                         f"{target!r}; the save finishes first (at most {bound:g} s; a second "
                         "signal stops at once).\n")
        sys.stderr.flush()
        threading.Thread(target=give_up, args=(signum,), daemon=True).start()

    def give_up(signum):
        if finished.wait(bound):
            return
        sys.stderr.write(f"AutoDist: the save of {target!r} did not finish within {bound:g} s "
                         f"of {signal.Signals(signum).name}; stopping without it (the previous "
                         "file is kept).\n")
        sys.stderr.flush()
        signal.pthread_kill(threading.main_thread().ident, signum)
        if not finished.wait(_EXIT_IF_STUCK_S):  # the main thread is stuck in a write
            os._exit(128 + signum)

    hold.holds_stops = True
    for signum in previous:
        signal.signal(signum, hold)
    try:
        yield
    finally:
        finished.set()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if held:
        _act_on(held[0], previous[held[0]], None)


def _act_on(signum: int, handler, frame) -> None:
    """Does what ``handler``, the one the process had, does on ``signum``."""
    if callable(handler):
        handler(signum, frame)
    elif handler == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    # SIG_IGN: nothing
