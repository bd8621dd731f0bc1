"""Horovod as a peer in ``peers.py``: its virtual environment, its rendezvous and its job.

Horovod 0.28.1 does not build against this environment's TensorFlow 2.21, so it
runs from a virtual environment of its own (``ensure_venv``): TensorFlow 2.15.1
(CPU) and Horovod built from source with Gloo only (no MPI, no other
frameworks). Building takes a few minutes (4 on a 2-core machine), once; a
venv that already imports ``horovod.tensorflow.keras`` is left as it is.

The job is what a new user writes: ``tf.keras`` (Keras 2 in TensorFlow 2.15)
``model.fit`` with ``hvd.DistributedOptimizer`` around the optimizer and
``hvd.callbacks.BroadcastGlobalVariablesCallback(0)``, on the model, data and
timer of ``keras_step_time`` (Horovod's default fusion and cycle time).

The launch replaces ``horovodrun --gloo``'s ssh step and keeps the rest of it:
a process in the first namespace starts Horovod's own ``RendezvousServer``,
initialises it with Horovod's host assignment for ``h1:1,...,hN:1`` and prints
the environment Horovod's Gloo launcher would give each rank
(``create_run_env_vars``, ``create_slot_env_vars``); the driver then starts rank
``i`` inside namespace ``i`` with that environment. ``horovodrun`` on remote
hosts needs an sshd in every namespace, an ssh key and a first pass probing the
hosts' interfaces over ssh; each of those can fail or hang on its own and none
of them is part of a training step.

After training every rank prints a SHA-256 of its weights, and the driver
checks that they are equal: averaged gradients leave the ranks bit-identical
(Gloo's ring hands every rank the same reduced bytes), while ranks that trained
on their own rows alone would differ. A job whose ranks differ is an error row,
not a too-fast time.
"""
from __future__ import annotations

import hashlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time

import keras_step_time as kst  # imports only the standard library until a job runs

SYSTEM = "Horovod"
DEFAULT_VENV = os.path.join(os.path.expanduser("~"), ".cache", "autodist", "horovod-venv")
TENSORFLOW = "tensorflow-cpu==2.15.1"
HOROVOD = "horovod==0.28.1"
BUILD_ENV = {"HOROVOD_WITH_TENSORFLOW": "1", "HOROVOD_WITH_GLOO": "1", "HOROVOD_WITHOUT_MPI": "1",
             "HOROVOD_WITHOUT_PYTORCH": "1", "HOROVOD_WITHOUT_MXNET": "1"}
IFACE = "eth0"  # the emulated hosts' cluster interface (emulate.HOST_IFACE)
_RENDEZVOUS_TAG = "HOROVOD_RENDEZVOUS "
_CHECKSUM_TAG = "HOROVOD_CHECKSUM "
_RENDEZVOUS_START_S = 120.0


# --------------------------------------------------------------------------- the venv

def venv_python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def venv_ready(venv: str) -> bool:
    """Whether ``venv``'s Python imports Horovod's Keras API (built with TensorFlow)."""
    if not os.path.exists(venv_python(venv)):
        return False
    probe = subprocess.run([venv_python(venv), "-c", "import horovod.tensorflow.keras"],
                           capture_output=True, timeout=300, check=False,
                           env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    return probe.returncode == 0


def versions(venv: str) -> str:
    """``"TensorFlow 2.15.1, Keras 2.15.0, Horovod 0.28.1"`` of the venv (for the docs)."""
    code = ("from importlib import metadata as m; print(', '.join(f'{n} {m.version(p)}' for n, p "
            "in (('TensorFlow', 'tensorflow-cpu'), ('Keras', 'keras'), ('Horovod', 'horovod'))))")
    out = subprocess.run([venv_python(venv), "-c", code], capture_output=True, text=True,
                         timeout=120, check=False)
    return out.stdout.strip() or "versions unknown"


def ensure_venv(venv: str, log=print) -> None:
    """Creates ``venv`` with TensorFlow 2.15 and Horovod (Gloo) unless it already imports Horovod.

    Idempotent: a venv a previous, interrupted set-up left half-built is completed.
    pip's output is shown as it comes and kept in ``<venv>.log``.

    Raises:
        RuntimeError: naming the step that failed and quoting the end of its output.
    """
    if venv_ready(venv):
        log(f"[horovod set-up] {venv} already imports horovod.tensorflow.keras; nothing to do")
        return
    _build_tools(log)
    os.makedirs(os.path.dirname(os.path.abspath(venv)), exist_ok=True)
    pip = [venv_python(venv), "-m", "pip", "--disable-pip-version-check", "install",
           "--progress-bar", "off"]
    jobs = os.environ.get("MAKEFLAGS") or f"-j{os.cpu_count() or 1}"  # Horovod's default is -j8
    steps = [
        ("create the venv", [sys.executable, "-m", "venv", venv], {}),
        (f"install {TENSORFLOW} (a 200 MB download)", pip + [TENSORFLOW], {}),
        (f"build {HOROVOD} with Gloo (minutes: it compiles C++)",
         pip + ["--no-build-isolation", "--no-cache-dir", HOROVOD],
         {**BUILD_ENV, "MAKEFLAGS": jobs}),
    ]
    with open(venv + ".log", "a", encoding="utf-8") as record:
        for i, (what, argv, extra) in enumerate(steps, start=1):
            log(f"[horovod set-up] step {i}/{len(steps)}: {what}")
            _stream(argv, {**os.environ, **extra}, record, log, f"step {i}/{len(steps)} ({what})",
                    venv + ".log")
    if not venv_ready(venv):
        raise RuntimeError(f"Horovod set-up: {venv} was built but does not import "
                           f"horovod.tensorflow.keras; see {venv}.log.")
    log(f"[horovod set-up] done: {versions(venv)} in {venv}")


def run_benchmark(args, needs_horovod: bool, run, setup_only: bool = False) -> int:
    """Runs a benchmark's ``run()``, building Horovod's venv first when ``needs_horovod``.

    A failed set-up is not fatal: it is kept in ``args.horovod_error`` so Horovod's
    rows say why they are missing (with ``setup_only``, where set-up is the whole
    job, it is raised). SIGTERM is handled like Ctrl-C: the benchmark's own
    clean-up runs and the exit status is 130.
    """
    args.horovod_error = None
    signal.signal(signal.SIGTERM, _interrupted)
    try:
        if needs_horovod or setup_only:
            try:
                ensure_venv(args.horovod_venv)
            except (RuntimeError, OSError, subprocess.SubprocessError) as err:
                if setup_only:
                    raise
                print(f"Horovod set-up failed; its rows are errors:\n{err}", file=sys.stderr)
                args.horovod_error = f"set-up failed: {str(err).splitlines()[0]}"
        return 0 if setup_only else run()
    except KeyboardInterrupt:
        print("\ninterrupted; every process this run started was stopped and any cluster removed",
              file=sys.stderr)
        return 130


def _interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _build_tools(log) -> None:
    """cmake and g++, which Horovod's build needs; installed with apt-get when missing."""
    missing = [tool for tool in ("cmake", "g++") if shutil.which(tool) is None]
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise RuntimeError(f"Horovod set-up: {missing} missing; install them (e.g. "
                           "'apt-get install cmake g++') and run again.")
    log(f"[horovod set-up] installing {missing} with apt-get")
    subprocess.run(["apt-get", "install", "-y", "cmake", "g++"], check=True)


def _stream(argv: list, env: dict, record, log, what: str, log_path: str) -> None:
    """Runs ``argv``, showing its output (and a heartbeat when it is quiet) and recording it."""
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    tail, last = [], [time.monotonic()]

    def read():
        for line in proc.stdout:
            record.write(line)
            tail.append(line)
            del tail[:-40]
            if not line.startswith("WARNING: Location"):  # pip's note on each absent find-links dir
                log(f"    {line.rstrip()}")
            last[0] = time.monotonic()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        while proc.poll() is None:
            reader.join(timeout=5)
            if time.monotonic() - last[0] > 120:
                log(f"    ... still running ({(time.monotonic() - start) / 60:.0f} min)")
                last[0] = time.monotonic()
        reader.join(timeout=10)
    except BaseException:
        proc.terminate()  # Ctrl-C: pip's compilers go with it
        proc.wait()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"Horovod set-up failed at {what} (exit {proc.returncode}); the end of "
                           f"its output ({log_path} has all):\n" + "".join(tail[-15:]))


# --------------------------------------------------------------------------- in the venv

def job(warmup: int, timed: int, build=None, data=None,
        batch: int = kst.ROWS_PER_REPLICA) -> None:
    """One Horovod rank: Keras 2 ``fit`` with the distributed optimizer and the broadcast.

    Args:
        build: makes the compiled model given ``wrap_optimizer=``, as
            ``kst.build_model`` (the default).
        data: ``data(seed, rows)`` -> (x, y), as ``kst.synthetic_data`` (the default).
        batch: the rank's rows per step.
    """
    kst.limit_threads()
    import horovod.tensorflow.keras as hvd
    import keras
    import numpy as np

    hvd.init()
    x, y = (data or kst.synthetic_data)(hvd.rank(), batch * (warmup + timed))
    keras.utils.set_random_seed(0)
    model = (build or kst.build_model)(wrap_optimizer=hvd.DistributedOptimizer)
    timer = kst.batch_timer(warmup)
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), timer])
    kst.print_cpu(SYSTEM, hvd.rank(), timer)  # its peak memory before the checksum's copies
    digest = hashlib.sha256()
    for weight in model.get_weights():
        digest.update(np.ascontiguousarray(weight).tobytes())
    kst.print_line(_CHECKSUM_TAG + json.dumps({"rank": hvd.rank(),
                                               "sha256": digest.hexdigest()}))
    if hvd.rank() == 0:
        kst.print_result(SYSTEM, timer)


def serve_rendezvous(hosts: list, address: str) -> None:
    """Horovod's rendezvous for one rank per host; prints each rank's environment, then serves
    until its standard input closes (or it is ended)."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars
    from horovod.runner.http.http_server import RendezvousServer

    plan = get_host_assignments(parse_hosts(",".join(f"{h}:1" for h in hosts)), len(hosts))
    server = RendezvousServer()
    port = server.start()
    server.init(plan)
    common = {k: str(v) for k, v in create_run_env_vars(address, [IFACE], port).items()}
    ranks = [{**common, **create_slot_env_vars(slot), "PYTHONUNBUFFERED": "1"} for slot in plan]
    print(_RENDEZVOUS_TAG + json.dumps(ranks), flush=True)
    sys.stdin.read()
    server.stop()


# --------------------------------------------------------------------------- the driver

def run(cluster, venv: str, args, job_argv: list = None) -> dict:
    """One Horovod job on ``cluster``: its row, or an error row.

    ``job_argv``: what each rank's Python runs, a script and its arguments (default:
    this file's job, ``--_job --warmup W --timed T``); it must print what
    :func:`job` prints.
    """
    python, here = venv_python(venv), os.path.abspath(__file__)
    job_argv = job_argv or [here, "--_job", "--warmup", str(args.warmup),
                            "--timed", str(args.timed)]
    chief = cluster.hosts[0]
    rendezvous = subprocess.Popen(
        chief.launch_prefix + [python, here, "--_rendezvous", chief.address,
                               *[h.name for h in cluster.hosts]],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=kst.job_env(), start_new_session=True)
    try:
        ranks = _read_ranks(rendezvous)
        if isinstance(ranks, str):
            return {"system": SYSTEM, "error": ranks}
        procs = [kst.start_job(host.launch_prefix + [python, *job_argv], kst.job_env(**env))
                 for host, env in zip(cluster.hosts, ranks)]
        outputs = kst.collect(procs, args.timeout)
    finally:
        kst.stop_job(rendezvous)
    row = kst.job_result(SYSTEM, outputs)
    digests = {}
    for _, out, _ in outputs:
        for line in (out or "").splitlines():
            if line.startswith(_CHECKSUM_TAG):
                rank = json.loads(line[len(_CHECKSUM_TAG):])
                digests[rank["rank"]] = rank["sha256"][:12]
    if "error" not in row and (len(digests) != len(outputs) or len(set(digests.values())) != 1):
        return {"system": SYSTEM, "error": f"the ranks' weights differ after training (sha256 "
                                           f"{digests}): the gradients were not averaged"}
    return row


def _read_ranks(proc: subprocess.Popen):
    """The rendezvous process's per-rank environments, or a one-line error."""
    deadline = time.monotonic() + _RENDEZVOUS_START_S
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            line = proc.stdout.readline()
            if line.startswith(_RENDEZVOUS_TAG):
                return json.loads(line[len(_RENDEZVOUS_TAG):])
            if not line:  # it ended
                err = [l for l in proc.stderr.read().splitlines() if l.strip()]
                return "rendezvous failed: " + (err[-1][:250] if err else f"exit {proc.wait()}")
    return f"rendezvous did not start within {_RENDEZVOUS_START_S:.0f} s"


def main(argv: list) -> int:
    """Job modes, run by the venv's Python: ``--_job --warmup W --timed T`` or
    ``--_rendezvous ADDRESS HOST...``."""
    if argv[:1] == ["--_rendezvous"]:
        serve_rendezvous(argv[2:], argv[1])
        return 0
    if argv[:1] == ["--_job"]:
        options = dict(zip(argv[1::2], argv[2::2]))
        job(int(options["--warmup"]), int(options["--timed"]))
        return 0
    print(f"{__doc__.splitlines()[0]}\nRun benchmarks/peers.py; this file's modes are its jobs.",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
