"""Keras saves that a stop cannot cut: written aside, then renamed into place.

``model.save`` and ``model.save_weights`` of a model compiled inside
``ad.scope()`` (and so ``ModelCheckpoint``, which calls them) write a
temporary file beside the target, named after the target, the host and the
process, and rename it over the target once it is complete. A process stopped
in the middle (SIGTERM, Ctrl-C, a failed node ending the job, SIGKILL) leaves
the previous file whole; nodes saving to one shared path each rename a whole
file of their own, the last one winning.

Saves that write several files (sharded weights, an unzipped model) or go
elsewhere than a local path pass through unchanged.
"""
from __future__ import annotations

import functools
import os
import socket
from typing import Callable

import keras

_SUFFIXES = (".weights.h5", ".keras", ".h5")


def save_atomically(model: keras.Model) -> None:
    """Makes ``model.save`` and ``model.save_weights`` write aside and rename."""
    cls = type(model)
    # Instance attributes: only this model changes, and Python looks them up first.
    model.save = functools.partial(_saved_aside, functools.partial(cls.save, model))
    model.save_weights = functools.partial(_saved_aside,
                                           functools.partial(cls.save_weights, model))


def temporary_path(filepath: str) -> str:
    """Where a save of ``filepath`` writes before the rename: beside it, hidden, named
    after it, this host and this process, with its suffix (which Keras checks)."""
    directory, name = os.path.split(os.path.abspath(filepath))
    suffix = next(s for s in _SUFFIXES if name.endswith(s))
    stem = name[:-len(suffix)]
    return os.path.join(directory, f".{stem}.autodist-{socket.gethostname()}-{os.getpid()}"
                                   f"{suffix}")


def _saved_aside(save: Callable, filepath, *args, **kwargs):
    path = os.fspath(filepath) if isinstance(filepath, (str, os.PathLike)) else None
    overwrite = kwargs.get("overwrite", args[0] if args else True)
    whole_file = (path is not None and "://" not in path and path.endswith(_SUFFIXES)
                  and not kwargs.get("max_shard_size") and kwargs.get("zipped") is not False)
    if not whole_file or (not overwrite and os.path.exists(path)):
        return save(filepath, *args, **kwargs)  # Keras's own behaviour (and its prompt)
    temporary = temporary_path(path)
    try:
        result = save(temporary, *args, **kwargs)
        os.replace(temporary, path)
        return result
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
