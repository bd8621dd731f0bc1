"""Saver: checkpoints in the single-device layout, whatever the strategy.

A checkpoint holds the original variables under their original names and full
shapes: partitions stitched, one copy of replicated variables, the optimizer's
slots under the names the single-device graph gives them. So a checkpoint of
plain TensorFlow restores under any strategy, and one written under any
strategy restores in plain TensorFlow or under another strategy.

A partitioned variable is written and restored part by part, each part as its
slice of the single-device variable, and the chief holds one shard of the
state at a time (``SHARD_BYTES``): a table kept in parts over several nodes is
never assembled on one.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil
from typing import Optional

import numpy as np
import tensorflow as tf

from autodist import _tf_compat
from autodist.kernels.locations import Location, Locator
from autodist.checkpoint.single_device import single_device_copy
from autodist.synchronizers.base import token_queue
from autodist.session import DistributedSession, as_tf_variable

RESTORE_TIMEOUT_S = 300.0
# A save or restore holds one shard of this size (or one variable part larger
# than it) on the chief at a time.
SHARD_BYTES = 256 << 20
_RESTORED = "restored"


@dataclasses.dataclass
class _Bound:
    """The saver's ops in one distributed graph."""

    saver: tf.compat.v1.train.Saver
    release: list           # chief: lets every worker go on after a restore
    wait: Optional[tf.Operation] = None  # worker: waits for the chief's restore


class Saver:
    """``tf.compat.v1.train.Saver`` for AutoDist sessions, writing the single-device layout.

    Create it inside ``ad.scope()`` after the optimizer (so its slots exist), and
    hand it the session of ``ad.create_distributed_session()``.

    Note:
        On a cluster only the chief writes checkpoints; every node must call
        ``restore`` (the same script runs everywhere) and reads ``save_path``
        itself, so the path must be readable on every node (a shared file
        system). A worker's ``restore`` returns once the chief's has finished.

    Args:
        var_list: the variables to save, as a list (saved under their names) or a
            dict of checkpoint name -> variable; by default every global variable
            of the graph, optimizer slots included.
        max_to_keep: how many recent checkpoints to keep.
        keep_checkpoint_every_n_hours: also keep one checkpoint per this many hours.
        pad_step_number: zero-pad the step number in checkpoint names.
        save_relative_paths: write relative paths in the ``checkpoint`` file.
    """

    def __init__(self, var_list=None, max_to_keep: int = 5,
                 keep_checkpoint_every_n_hours: float = 10000.0, pad_step_number: bool = False,
                 save_relative_paths: bool = False):
        self._graph = tf.compat.v1.get_default_graph()
        if var_list is None:
            var_list = tf.compat.v1.global_variables()
        if isinstance(var_list, dict):
            pairs = [(key, as_tf_variable(v)) for key, v in var_list.items()]
        else:
            pairs = [(v.op.name, v) for v in map(as_tf_variable, var_list)]
        self._names = {key: variable.op.name for key, variable in pairs}
        self._shapes = {key: tuple(variable.shape.as_list()) for key, variable in pairs}
        self._dtypes = {key: variable.dtype.base_dtype for key, variable in pairs}
        self._options = dict(max_to_keep=max_to_keep, pad_step_number=pad_step_number,
                             keep_checkpoint_every_n_hours=keep_checkpoint_every_n_hours,
                             save_relative_paths=save_relative_paths)
        self._bound = {}
        self._meta_graph = None

    @property
    def names(self) -> dict:
        """Checkpoint name -> op name of the variable in the single-device graph."""
        return dict(self._names)

    @property
    def last_checkpoints(self) -> list:
        """Paths of the checkpoints still kept, oldest first (this process's saves)."""
        bound = list(self._bound.values())
        return bound[-1].saver.last_checkpoints if bound else []

    def save(self, sess: DistributedSession, save_path: str, global_step=None,
             latest_filename: Optional[str] = None, meta_graph_suffix: str = "meta",
             write_meta_graph: bool = True, write_state: bool = True) -> Optional[str]:
        """Writes a checkpoint of the variables (on the chief; elsewhere does nothing).

        Args:
            sess: the AutoDist session.
            save_path: the checkpoint's path prefix.
            global_step: a number, or a tensor or variable of the graph, appended
                to ``save_path``.
            latest_filename: name of the state file (default ``checkpoint``).
            meta_graph_suffix: suffix of the meta graph file.
            write_meta_graph: also write the single-device graph's MetaGraphDef,
                restorable with ``tf.compat.v1.train.import_meta_graph``.
            write_state: record the checkpoint in the state file.

        Returns:
            the checkpoint's path prefix, or None on a node other than the chief.

        Raises:
            CheckpointError: (a ValueError) when the files cannot be written, naming
                the path and the cause (permission, a full disk, ...); the files of
                the failed save are removed.
        """
        bound = self._bind(sess)
        if not sess.distributed.ctx.is_chief:
            return None
        if global_step is not None and not isinstance(global_step, (int, np.integer)):
            global_step = int(sess.run(global_step))
        # Every file appears complete or not at all (TensorFlow writes the data and
        # the index under temporary names, the meta graph is written so here), and
        # the state file changes last: a save interrupted at any point leaves
        # latest_checkpoint at the previous, complete checkpoint.
        latest_filename = latest_filename or "checkpoint"
        _remove_leftovers(save_path, latest_filename)  # of a save killed before
        try:
            # Several shards are written into a directory beside the checkpoint, which
            # TensorFlow creates, but not the checkpoint's own if that is missing.
            if os.path.dirname(save_path):
                tf.io.gfile.makedirs(os.path.dirname(save_path))
            path = bound.saver.save(sess.tf_session, save_path, global_step=global_step,
                                    latest_filename=latest_filename, write_meta_graph=False,
                                    write_state=False)
            if write_meta_graph:
                _write_atomically(f"{path}.{meta_graph_suffix}",
                                  self._single_device_meta_graph().SerializeToString())
            if write_state:
                _tf_compat.record_checkpoint(bound.saver, path, os.path.dirname(save_path),
                                             latest_filename, meta_graph_suffix)
        except (tf.errors.OpError, OSError, ValueError) as err:
            _remove_leftovers(save_path, latest_filename)
            raise CheckpointError(f"autodist.checkpoint.Saver.save: could not write "
                                  f"'{save_path}': {_cause(err)}") from err
        return path

    def restore(self, sess: DistributedSession, save_path: str,
                timeout: float = RESTORE_TIMEOUT_S) -> None:
        """Restores the variables from a checkpoint in the single-device layout.

        Args:
            sess: the AutoDist session.
            save_path: the checkpoint's path prefix (e.g. from ``latest_checkpoint``).
            timeout: how long a worker waits for the chief's restore, in seconds.

        Raises:
            CheckpointError: (a ValueError) when there is no checkpoint at
                ``save_path``, it is corrupt or cut short, or it lacks a variable or
                holds it in another shape or dtype, naming the path and the cause.
            TimeoutError: when, on a worker, the chief does not restore in time.
        """
        if save_path is None:
            raise ValueError("autodist.checkpoint.Saver.restore: save_path is None; "
                             "is there a checkpoint (latest_checkpoint returned None)?")
        bound = self._bind(sess)
        _check_checkpoint(save_path, self._shapes, self._dtypes)
        try:
            bound.saver.restore(sess.tf_session, save_path)
        except tf.errors.OpError as err:
            raise CheckpointError(f"autodist.checkpoint.Saver.restore: cannot read "
                                  f"'{save_path}': {_cause(err)}") from None
        if bound.release:
            sess.tf_session.run(bound.release)
        if bound.wait is not None:
            try:
                sess.tf_session.run(bound.wait, options=tf.compat.v1.RunOptions(
                    timeout_in_ms=int(timeout * 1000)))
            except tf.errors.DeadlineExceededError:
                raise TimeoutError(f"The chief did not restore '{save_path}' within "
                                   f"{timeout:.0f} s; does it call restore too?") from None

    def _bind(self, sess: DistributedSession) -> _Bound:
        """This saver's ops in the session's distributed graph, built on first use."""
        if not isinstance(sess, DistributedSession):
            raise TypeError(
                f"autodist.checkpoint.Saver needs the session of "
                f"ad.create_distributed_session(), not a {type(sess).__name__}; use "
                "tf.compat.v1.train.Saver for a plain session.")
        distributed = sess.distributed
        if distributed.item.graph is not self._graph:
            raise ValueError("autodist.checkpoint.Saver: the session runs another graph than "
                             "the one the saver was created in.")
        if distributed.graph not in self._bound:
            self._bound[distributed.graph] = self._build(distributed)
        return self._bound[distributed.graph]

    def _build(self, distributed) -> _Bound:
        ctx, locator = distributed.ctx, Locator(distributed)
        entries, unknown = [], []
        with distributed.graph.as_default(), tf.device(ctx.shared_device):
            for key, name in self._names.items():
                location = locator.find(name)
                if location is None:
                    unknown.append(name)
                    continue
                entries.extend(self._entries(key, location, ctx.is_chief, ctx.shared_device))
            if unknown:
                raise ValueError(
                    f"autodist.checkpoint.Saver: {sorted(unknown)} have no counterpart in the "
                    "distributed graph (created after the session, or not part of the model).")
            saver = _tf_compat.piecewise_saver(entries, SHARD_BYTES, **self._options)
            release, wait = [], None
            if ctx.multi_node and ctx.is_chief:
                release = [token_queue(w, ctx, _RESTORED).enqueue(tf.constant(0, tf.int64))
                           for w in range(1, ctx.num_nodes)]
            elif ctx.multi_node:
                wait = token_queue(ctx.node_index, ctx, _RESTORED).dequeue().op
        return _Bound(saver, release, wait)

    def _entries(self, key: str, location: Location, is_chief: bool, device: str) -> list:
        """The checkpoint entries of one variable: one per part, each holding the part's
        slice of the single-device variable, so no device assembles a partitioned
        variable whole to save or restore it."""
        shape, dtype = self._shapes[key], self._dtypes[key]
        plan = location.plan
        pieces = ([(shape, None)] if plan is None else
                  [(plan.part_shape(index), tf.compat.v1.Variable.SaveSliceInfo(
                      key, list(shape), [offset if axis == plan.axis else 0
                                         for axis in range(len(shape))],
                      list(plan.part_shape(index))).spec)
                   for index, offset in enumerate(plan.offsets)])
        entries = []
        for index, (piece_shape, spec) in enumerate(pieces):
            # Only the chief saves; elsewhere the entry needs a tensor of the
            # right shape and type that no run evaluates.
            if is_chief and location.readable:
                value = location.value if plan is None else location.reads[index]
            else:
                value = functools.partial(tf.zeros, piece_shape, dtype)
            entries.append(_tf_compat.checkpoint_entry(
                key, value, functools.partial(location.restore_part, index), dtype=dtype,
                device=device, nbytes=int(np.prod(piece_shape)) * dtype.size,
                slice_spec=spec or ""))
        return entries

    def _single_device_meta_graph(self):
        if self._meta_graph is None:
            copy, saver = single_device_copy(self._graph, self._names)
            self._meta_graph = tf.compat.v1.train.export_meta_graph(
                graph=copy, saver_def=saver.as_saver_def(), clear_devices=True)
        return self._meta_graph


def latest_checkpoint(checkpoint_dir: str, latest_filename: Optional[str] = None
                      ) -> Optional[str]:
    """The newest complete checkpoint recorded in ``checkpoint_dir``, or None."""
    return tf.compat.v1.train.latest_checkpoint(checkpoint_dir, latest_filename)


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read, naming its path and the cause."""


def _cause(err: BaseException) -> str:
    """What went wrong, in a user's words, from a TensorFlow or OS error."""
    lines = [line.strip() for line in (getattr(err, "message", None) or str(err)).splitlines()]
    # A failed run's message opens with boilerplate and ends with where it ran.
    text = "\n".join(line for line in lines if line and line != "Graph execution error:"
                     and not line.startswith(("Detected at node", "File ", "Node:")))
    if getattr(err, "errno", None) == 30 or "Read-only file system" in text:
        return "the directory is on a read-only file system."
    if isinstance(err, tf.errors.PermissionDeniedError) or getattr(err, "errno", None) == 13:
        return "permission denied (check the directory's permissions)."
    if (isinstance(err, tf.errors.ResourceExhaustedError) or getattr(err, "errno", None) == 28
            or "No space left" in text):
        return "the disk is full."
    # TensorFlow reports bytes that fail their checksum as data loss, a file
    # shorter than its index says as out of range: each names its own cause.
    if isinstance(err, tf.errors.DataLossError):
        return f"the files are corrupt ({text.splitlines()[0][:200]})."
    if isinstance(err, tf.errors.OutOfRangeError):
        return f"the files are cut short ({text.splitlines()[0][:200]})."
    if isinstance(err, tf.errors.NotFoundError):
        return f"a file or directory is missing ({text.splitlines()[0][:200]})."
    return f"{type(err).__name__}: {text.splitlines()[0][:300] if text else ''}"


def _write_atomically(path: str, data: bytes) -> None:
    """Writes ``path`` under a temporary name, flushed to disk, then renames it."""
    temporary = f"{path}{_TEMPORARY}{os.getpid()}"
    try:
        with open(temporary, "wb") as target:
            target.write(data)
            target.flush()
            os.fsync(target.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


_TEMPORARY = ".autodist-tmp-"
# What TensorFlow leaves of a killed save: its data/index temporaries and sharded
# temp directories, and the state file's temporary.
_LEFTOVERS = (".tempstate", "_temp", _TEMPORARY)


def _remove_leftovers(save_path: str, latest_filename: str) -> None:
    """Removes the temporary files an interrupted save of ``save_path`` left behind."""
    directory = os.path.dirname(save_path) or "."
    stem = os.path.basename(save_path)
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        ours = name.startswith(stem) or name.startswith(f"{latest_filename}.tmp")
        if not ours or not (name.startswith(f"{latest_filename}.tmp")
                            or any(mark in name for mark in _LEFTOVERS)):
            continue
        target = os.path.join(directory, name)
        try:
            if os.path.isdir(target):
                shutil.rmtree(target)
            else:
                os.unlink(target)
        except OSError:
            pass


def _missing_data_file(save_path: str) -> Optional[str]:
    """The first data file of checkpoint ``save_path`` that does not exist, or None.

    The data files are ``{save_path}.data-{i:05d}-of-{n:05d}``, i from 0 to n - 1.
    """
    directory, stem = os.path.split(save_path)
    shards = re.compile(re.escape(stem) + r"\.data-(\d{5})-of-(\d{5})")
    try:
        names = tf.io.gfile.listdir(directory or ".")
    except tf.errors.OpError:
        names = []
    found = [match for match in map(shards.fullmatch, names) if match]
    count = int(found[0].group(2)) if found else 1
    present = {int(match.group(1)) for match in found if int(match.group(2)) == count}
    for shard in range(count):
        if shard not in present:
            return f"{save_path}.data-{shard:05d}-of-{count:05d}"
    return None


def _check_checkpoint(save_path: str, shapes: dict, dtypes: dict) -> None:
    """Raises a CheckpointError naming what keeps ``save_path`` from restoring the model."""
    if not tf.io.gfile.exists(f"{save_path}.index"):
        raise CheckpointError(f"autodist.checkpoint.Saver.restore: no checkpoint at "
                              f"'{save_path}' (its .index file is missing).")
    # Reading the index opens no data file, and a restore missing one blames a
    # variable missing from the graph; so both files are checked here.
    absent = _missing_data_file(save_path)
    if absent:
        raise CheckpointError(f"autodist.checkpoint.Saver.restore: cannot read '{save_path}': "
                              f"its data file '{absent}' is missing.")
    try:
        reader = tf.train.load_checkpoint(save_path)
        stored = reader.get_variable_to_shape_map()
        stored_dtypes = reader.get_variable_to_dtype_map()
    except (tf.errors.OpError, ValueError) as err:
        # Only the index is read here. TensorFlow reports a damaged one as a bare
        # OpError ("not an sstable", "block checksum mismatch"), naming no cause.
        detail = (getattr(err, "message", "") or "").strip().splitlines()
        cause = (f"its index file '{save_path}.index' is corrupt or cut short "
                 f"({detail[0][:200] if detail else 'unreadable'})."
                 if type(err) is tf.errors.OpError else _cause(err))
        raise CheckpointError(f"autodist.checkpoint.Saver.restore: cannot read '{save_path}': "
                              f"{cause}") from None
    missing = sorted(key for key in shapes if key not in stored)
    wrong = sorted(f"{key} {list(stored[key])} (the model has {list(shape)})"
                   for key, shape in shapes.items()
                   if key in stored and tuple(stored[key]) != shape)
    other_types = sorted(f"{key} {stored_dtypes[key].name} (the model has {dtypes[key].name})"
                         for key in shapes if key in stored
                         and stored_dtypes[key].base_dtype != dtypes[key])
    if missing or wrong or other_types:
        raise CheckpointError(f"Checkpoint '{save_path}' does not fit the model: "
                              + "; ".join(filter(None, [
                                  f"missing {missing}" if missing else "",
                                  f"other shapes: {', '.join(wrong)}" if wrong else "",
                                  f"other dtypes: {', '.join(other_types)}" if other_types
                                  else ""])) + ".")
