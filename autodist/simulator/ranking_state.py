"""The ranking simulator's file format: one ``.npz`` with a JSON state and named arrays.

A plain archive of numpy arrays, read with ``allow_pickle=False``, rather than
Keras' model saving: it holds nothing executable, does not depend on how Keras
serializes subclassed models from one release to the next, and the JSON part
(format, version, config, normalization fields) can be read by eye.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Tuple

import numpy as np

__all__ = ["FORMAT", "VERSION", "SimulatorStateError", "read_state", "write_state"]

FORMAT = "autodist.RankingSimulator"
VERSION = 1
_STATE_KEY = "state"


class SimulatorStateError(ValueError):
    """A saved simulator state cannot be read or does not fit; the message names the file."""


def write_state(path: str, state: Dict[str, Any], arrays: Dict[str, np.ndarray]) -> None:
    """Writes ``state`` (JSON-able, format and version added) and ``arrays`` to ``path``.

    The file is written beside ``path`` and renamed over it, so a crash never
    leaves a half-written state where a good one was.

    Args:
        path: the file to write; its directory must exist.
        state: JSON-serializable fields.
        arrays: named numpy arrays (names must not be ``"state"``).
    """
    payload = dict(arrays)
    payload[_STATE_KEY] = np.array(json.dumps({"format": FORMAT, "version": VERSION, **state}))
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:  # a file object: numpy would append ".npz" to a name
            np.savez(f, **payload)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_state(path: str) -> Tuple[Dict[str, Any], Dict[str, np.ndarray]]:
    """Reads a file written by :func:`write_state`.

    Args:
        path: the file.

    Returns:
        tuple: the state dict and the named arrays.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        SimulatorStateError: ``path`` is not such a file (not a zip archive,
            truncated, no state, another format or version); names ``path``.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"No RankingSimulator state file at {path!r}.")
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
        state = json.loads(str(arrays.pop(_STATE_KEY)))
        if not isinstance(state, dict):
            raise ValueError(f"the state is a {type(state).__name__}, not an object")
        if state.get("format") != FORMAT or state.get("version") != VERSION:
            raise ValueError(f"format {state.get('format')!r} version {state.get('version')!r}, "
                             f"expected {FORMAT!r} version {VERSION}")
    except Exception as err:  # zip, JSON, key and value errors alike mean a bad file
        raise SimulatorStateError(f"Cannot read a RankingSimulator state from {path!r}: "
                                  f"{type(err).__name__}: {err}") from err
    return state, arrays
