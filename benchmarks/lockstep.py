"""Lockstep timing of Keras ``fit`` steps: each system in a process of its own, one step each in turn.

The coordinator (:func:`run_round`) starts one process per system and lets them
run one training batch at a time, in turn (the order reversed every other
cycle). A process waits before each batch until it is let go, times the
batch's ``train_function`` call and reports the seconds before the next
process runs. So every system runs alone on the cores, and the
machine's speed, which may drift by a third over seconds, moves the steps of
one cycle alike: the ratio of two systems' steps in the same cycle is steadier
than the ratio of their medians.

A worker process calls :func:`time_steps` on its model before ``fit`` and
:func:`finished` after ``fit``; the coordinator needs no TensorFlow.
"""
from __future__ import annotations

import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
from typing import Dict, List, Optional, Sequence

# A worker's lines to the coordinator: waiting for its go, a batch's seconds, fit's end.
READY, STEP_TAG, DONE = "LOCKSTEP_READY", "LOCKSTEP_STEP ", "LOCKSTEP_DONE"


def time_steps(model) -> None:
    """Makes ``model.fit`` wait for the coordinator's go before each batch and report the
    seconds of the batch's ``train_function`` call after it.

    The call is timed, not ``on_train_batch_begin`` -> ``on_train_batch_end``: a
    callback with batch hooks is Keras code run between batches, which AutoDist
    must let see the model's state at every step (the cost of such a callback,
    not of the step). Keras's loop around the call is the same for every system.

    Args:
        model: a compiled ``keras.Model`` (under any system), before ``fit``.
    """
    import time

    make_train_function = model.make_train_function

    def make_timed(force=False):
        make_train_function(force)  # Keras's sets model.train_function (returns None)
        train_function = model.train_function
        if getattr(train_function, "lockstep_timed", False):
            return train_function

        def timed(iterator):
            print(READY, flush=True)
            sys.stdin.readline()  # the coordinator's go
            start = time.perf_counter()
            logs = train_function(iterator)
            print(f"{STEP_TAG}{time.perf_counter() - start}", flush=True)
            return logs

        timed.lockstep_timed = True
        model.train_function = timed
        return timed

    model.make_train_function = make_timed


def finished() -> None:
    """Tells the coordinator the worker's ``fit`` has ended."""
    print(DONE, flush=True)


class Worker:
    """One system's process, driven a batch at a time; a process silent for ``timeout``
    seconds counts as failed (``error`` says why, ``done`` is then true).

    Args:
        system: the name the coordinator knows the process by.
        command: the process's argument vector.
        timeout: seconds the process may stay silent.
        env: its environment (default: this one's, TensorFlow's C++ logging quietened).
    """

    def __init__(self, system: str, command: Sequence[str], timeout: float,
                 env: Optional[dict] = None):
        env = env if env is not None else {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
        self.system, self.error, self.done = system, None, False
        self._timeout = timeout
        self._stderr = tempfile.TemporaryFile(mode="w+")  # a pipe left unread could fill
        self._process = subprocess.Popen(list(command), stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=self._stderr,
                                         text=True, env=env)
        self._lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._wait_ready()

    def _read(self) -> None:
        for line in self._process.stdout:
            self._lines.put(line.strip())
        self._lines.put(None)  # the process closed its output

    def _line(self) -> str:
        try:
            line = self._lines.get(timeout=self._timeout)
        except queue.Empty:
            line = None
            self._process.kill()
            self.error = f"silent for {self._timeout:.0f} s"
        if line is None:
            self.done = True
            self._process.wait()
            if self.error is None:
                self._stderr.seek(0)
                self.error = (self._stderr.read().strip().splitlines() or ["no output"])[-1]
            return ""
        return line

    def _wait_ready(self) -> None:
        """Reads to the process's next ``ready`` (or its end)."""
        while not self.done:
            line = self._line()
            if line == READY:
                return
            if line == DONE:
                self.done = True

    def step(self) -> Optional[float]:
        """Lets the process run one batch; its seconds, once it waits for the next."""
        try:
            self._process.stdin.write("go\n")
            self._process.stdin.flush()
        except BrokenPipeError:
            pass  # it ended: _line reads why
        seconds = None
        while not self.done and seconds is None:
            line = self._line()
            if line.startswith(STEP_TAG):
                seconds = float(line[len(STEP_TAG):])
        self._wait_ready()
        return seconds

    def close(self) -> None:
        self._process.kill()
        self._process.wait()
        self._stderr.close()


def run_round(commands: Dict[str, Sequence[str]], timeout: float,
              env: Optional[dict] = None) -> Dict[str, Optional[List[float]]]:
    """One lockstep run of fresh processes, one per system, until the first ends.

    Args:
        commands: system -> the command of its worker process, in the cycle's order.
        timeout: seconds a process may take for one step (or its start).
        env: the processes' environment (see :class:`Worker`).

    Returns:
        dict: system -> its steps' seconds, the steps of one cycle at one index, or None
        when its process failed (the reason is printed).
    """
    workers = []
    try:
        for system, command in commands.items():
            workers.append(Worker(system, command, timeout, env))
        steps = {worker.system: [] for worker in workers}
        cycle = 0
        while all(not worker.done for worker in workers):
            for worker in (workers if cycle % 2 == 0 else workers[::-1]):
                steps[worker.system].append(worker.step())
            cycle += 1
    finally:
        for worker in workers:
            worker.close()
    for worker in workers:
        if worker.error:
            print(f"{worker.system} failed: {worker.error}", flush=True)
            steps[worker.system] = None
    return steps


def median_step(steps: Optional[List[float]], warmup: int) -> Optional[float]:
    """The median of ``steps`` after the first ``warmup`` (None for a failed or short run)."""
    timed = [s for s in (steps or [])[warmup:] if s is not None]
    return statistics.median(timed) if timed else None


def cycle_ratio(over: Optional[List[float]], under: Optional[List[float]],
                warmup: int) -> Optional[float]:
    """The median over the cycles after ``warmup`` of ``over``'s step / ``under``'s step
    in the same cycle (None when either run failed or no cycle is left)."""
    if not over or not under:
        return None
    pairs = [(a, b) for a, b in zip(over[warmup:], under[warmup:])
             if a is not None and b is not None]
    return statistics.median(a / b for a, b in pairs) if pairs else None
