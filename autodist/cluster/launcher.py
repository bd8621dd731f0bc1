"""Starts the user's script on the other nodes of a cluster and stops it again.

Three ways to reach a node, chosen per node from the resource spec:

* ``launch_prefix`` (e.g. ``[ip, netns, exec, h2]``, or an ``srun``/``kubectl exec``
  prefix): the prefix followed by the command, run from here;
* an ``ssh_config``: ``ssh`` to the node's address with that config;
* neither, on a local address: a plain subprocess.

Every worker gets its own process group, so stopping it stops its children too.
"""
from __future__ import annotations

import dataclasses
import json
import os
import select
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

from autodist.resource_spec import NodeSpec, SSHConfig

LOCAL_ADDRESSES = ("localhost", "127.0.0.1", "::1")
SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
               "-o", "UserKnownHostsFile=/dev/null", "-o", "ConnectTimeout=10",
               "-o", "LogLevel=ERROR")


class LaunchError(RuntimeError):
    """A node could not be started, or its process ended badly."""


# What usually sends a worker a signal nobody asked for.
_KILL_CAUSES = {signal.SIGKILL: " (the kernel's out-of-memory killer sends it when the node runs "
                                "out of memory or its process group hits a memory cap, such as "
                                "a cgroup's or `autodist emulate --memory`)"}


@dataclasses.dataclass
class WorkerProcess:
    """A launched worker: the node it runs on and its local process.

    Attributes:
        ssh_log: for a worker reached over ssh, the file ssh writes its own errors
            to (a refused key, an unreachable node), so that :meth:`failure` can
            name them.
    """

    node: str
    process: subprocess.Popen
    command: list
    ssh_log: Optional[str] = None

    def exit_code(self) -> Optional[int]:
        return self.process.poll()

    def failure(self) -> str:
        """Why the ended process failed: its exit code, and what ssh said if it failed."""
        said = ""
        if self.ssh_log:
            try:
                with open(self.ssh_log, errors="replace") as log:
                    said = " ".join(log.read().split())
            except OSError:
                pass
        code = self.process.poll()
        if said:
            return f"ssh could not run its process (exit code {code}): {said[-500:]}"
        if code is not None and code < 0:
            return f"its process was killed by {signal.Signals(-code).name}{_KILL_CAUSES.get(-code, '')}."
        return f"its process exited with code {code}."

    def stop(self, grace: float = 5.0) -> None:
        """Stops the worker's whole process group: SIGTERM, then SIGKILL after ``grace`` s."""
        try:
            self._stop(grace)
        finally:
            if self.ssh_log:
                try:
                    os.unlink(self.ssh_log)
                except OSError:
                    pass

    def _stop(self, grace: float) -> None:
        if self.process.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, grace)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue


def worker_command(node: NodeSpec, ssh: Optional[SSHConfig], env: dict,
                   argv: list, cwd: str, ssh_log: Optional[str] = None) -> list:
    """The command that runs ``argv`` (a Python script and its arguments) on ``node``.

    ``ssh_log``: where ssh writes its own errors, instead of standard error.

    Raises:
        LaunchError: when a remote node has neither a launch prefix nor an ssh config.
    """
    assignments = [f"{key}={value}" for key, value in sorted(env.items())]
    if node.launch_prefix:
        return [*node.launch_prefix, "env", *assignments, sys.executable, *argv]
    if ssh is None:
        if node.address in LOCAL_ADDRESSES:
            return ["env", *assignments, sys.executable, *argv]
        raise LaunchError(
            f"Node '{node.address}' is remote but has neither 'ssh_config' nor "
            "'launch_prefix' in the resource spec; add one so AutoDist can start it.")
    shared = [f"{k}={v}" for k, v in sorted(ssh.shared_envs.items())]
    remote = " ".join(shlex.quote(part) for part in
                      ["env", *shared, *assignments, "python3", *argv])
    if ssh.python_venv:
        remote = f"{ssh.python_venv} && {remote}"
    remote = f"cd {shlex.quote(cwd)} && {remote}"
    command = ["ssh", *SSH_OPTIONS, "-p", str(ssh.port)]
    if ssh.key_file:
        command += ["-i", ssh.key_file]
    if ssh_log:
        command += ["-E", ssh_log]
    return [*command, f"{ssh.username}@{node.address}", remote]


SECRETS_ON_STDIN_ENV = "AUTODIST_SECRETS_ON_STDIN"


def launch(node: NodeSpec, ssh: Optional[SSHConfig], env: dict, argv: list,
           cwd: str, secrets: Optional[dict] = None) -> WorkerProcess:
    """Starts the worker for ``node``; its output goes to this process's output.

    ``env`` travels on the command line (any launch prefix passes it on);
    ``secrets`` travel on the worker's standard input, one JSON line, so that
    no other user of the node sees them in the process list (``read_secrets``).

    Raises:
        LaunchError: naming the node when the command cannot be started.
    """
    ssh_log = None
    if ssh is not None and not node.launch_prefix:
        # ssh's own messages would be lost among the worker's output; the
        # failure of a worker that never started names them instead.
        descriptor, ssh_log = tempfile.mkstemp(prefix="autodist-ssh-", suffix=".log")
        os.close(descriptor)
    command = worker_command(node, ssh, {**env, SECRETS_ON_STDIN_ENV: "1"} if secrets else env,
                             argv, cwd, ssh_log)
    try:
        process = subprocess.Popen(command, cwd=cwd, start_new_session=True,
                                   stdin=subprocess.PIPE if secrets else subprocess.DEVNULL)
    except OSError as err:
        if ssh_log:
            os.unlink(ssh_log)
        raise LaunchError(f"Could not start the worker on node '{node.address}' "
                          f"with {command[0]!r}: {err}") from None
    if secrets:
        try:
            process.stdin.write((json.dumps(secrets) + "\n").encode())
            process.stdin.close()
        except OSError:  # the worker already ended; its exit code tells why
            pass
    return WorkerProcess(node.address, process, command, ssh_log)


def read_secrets(timeout: float = 60.0) -> dict:
    """In a worker: the secrets ``launch`` sent on standard input ({} when it sent none).

    Raises:
        LaunchError: when they do not arrive within ``timeout`` seconds (a launch
            prefix that does not pass standard input on, e.g. ``kubectl exec``
            without ``-i``), or when ``AUTODIST_SECRETS_ON_STDIN`` is neither unset nor 1.
    """
    flag = os.environ.get(SECRETS_ON_STDIN_ENV)
    if flag is None:
        return {}
    if flag != "1":
        raise LaunchError(f"{SECRETS_ON_STDIN_ENV}={flag[:40]!r} is not 1: the chief sets it "
                          "to 1 for the workers it launches; unset it otherwise.")
    ready, _, _ = select.select([sys.stdin], [], [], timeout)
    line = sys.stdin.readline() if ready else ""
    try:
        return json.loads(line)
    except ValueError:
        raise LaunchError(
            f"AutoDist worker: the chief's job token did not arrive on standard input within "
            f"{timeout:.0f} s; the launch prefix must pass standard input on (e.g. "
            "'kubectl exec -i').") from None


def stop_all(workers: list, grace: float = 5.0) -> None:
    """Stops every worker; returns when all are gone."""
    deadline = time.monotonic() + grace
    for worker in workers:
        if worker.process.poll() is None:
            try:
                os.killpg(worker.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for worker in workers:
        worker.stop(max(0.1, deadline - time.monotonic()))
