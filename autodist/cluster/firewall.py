"""Only the job reaches its TensorFlow servers: packet-filter rules on every node.

TensorFlow's gRPC server runs any graph a client sends, unauthenticated, as the
user that started it: it reads and writes whatever that user may. AutoDist
starts one on every node of a multi-node job, on ``AUTODIST_TF_PORT`` of every
interface. Before it starts, the node admits connections to that port from the
resource spec's nodes and its own loopback only, and resets every other (a
stray client fails at once instead of hanging).

The rules live as long as the server, that is as long as the node's process: a
guardian process sets them, and removes them when a pipe from the node closes,
which happens however the node ends (it returns, fails, or is killed with
SIGKILL). Each node's rules are a chain of their own, ``AUTODIST-<port>-<pid>``,
which ``INPUT`` jumps to for the port.

Setting rules needs root and ``iptables`` (``ip6tables`` too where present).
Without them the node says so once, naming the port and what protects it then.

This file needs only the standard library: the guardian runs it as a script,
without importing TensorFlow.
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import threading
import warnings
from typing import Dict, List, Sequence

CHAIN_PREFIX = "AUTODIST-"
READY = "ready"
START_TIMEOUT_S = 20.0


def chain_name(port: int, pid: int) -> str:
    """The chain of the rules guarding ``port`` for the node process ``pid``."""
    return f"{CHAIN_PREFIX}{port}-{pid}"


def protect_tf_port(port: int, node_addresses: Sequence[str]) -> bool:
    """Admits only ``node_addresses`` (and loopback) to TCP ``port`` while this process lives.

    Returns:
        whether the rules are set; False after a warning when they cannot be
        (not root, no iptables).

    Raises:
        RuntimeError: when iptables, run as root, could not set them, with its message,
            or a node's name does not resolve.
    """
    if os.geteuid() != 0 or "iptables" not in _binaries():
        why = ("this node does not run as root" if os.geteuid() != 0
               else "iptables is not installed")
        warnings.warn(
            f"AutoDist cannot restrict TensorFlow's port {port} to the job's nodes ({why}): "
            "anyone who can reach this node on that port can run any TensorFlow op here as "
            "this user. Run the job as root with iptables installed, or keep its nodes on a "
            "private network that only they reach.", RuntimeWarning, stacklevel=2)
        return False
    sources = _addresses(node_addresses)
    watch, keep = os.pipe()  # ``keep`` stays open until this process ends, however it ends
    command = [sys.executable, os.path.abspath(__file__), "--port", str(port),
               "--chain", chain_name(port, os.getpid()), "--watch-fd", str(watch),
               "--allow", ",".join(sources)]
    guardian = subprocess.Popen(command, pass_fds=(watch,), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    os.close(watch)
    # Reaps the guardian when it ends, after this process: nothing else holds it.
    threading.Thread(target=guardian.wait, name="autodist-port-guardian", daemon=True).start()
    with selectors.DefaultSelector() as selector:
        selector.register(guardian.stdout, selectors.EVENT_READ)
        ready = selector.select(START_TIMEOUT_S) and guardian.stdout.readline().strip() == READY
    if not ready:
        os.close(keep)  # the guardian removes whatever it set
        try:
            error = guardian.communicate(timeout=5.0)[1].strip()
        except subprocess.TimeoutExpired:
            error = ""
        raise RuntimeError(f"AutoDist could not restrict TensorFlow's port {port} to the "
                           f"job's nodes: {error or f'no answer within {START_TIMEOUT_S:g} s'}")
    return True


def _binaries() -> Dict[str, str]:
    return {name: path for name in ("iptables", "ip6tables")
            if (path := shutil.which(name)) is not None}


def _addresses(node_addresses: Sequence[str]) -> List[str]:
    """Every IP address the nodes' names resolve to, sorted.

    Raises:
        RuntimeError: naming a node whose name does not resolve: leaving it out of
            the rules would shut it out of the job.
    """
    resolved = set()
    for address in node_addresses:
        try:
            infos = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
        except OSError as err:
            raise RuntimeError(f"AutoDist cannot admit node {address!r} to TensorFlow's port: "
                               f"its name does not resolve here ({err.strerror or err}).") \
                from None
        resolved.update(info[4][0].split("%")[0] for info in infos)  # no IPv6 zone
    return sorted(resolved)


def _rules(port: int, chain: str, sources: List[str], version: int) -> List[List[str]]:
    """The iptables arguments setting the chain of one IP version, in order."""
    rules = [["-N", chain], ["-A", chain, "-i", "lo", "-j", "ACCEPT"]]
    rules += [["-A", chain, "-s", source, "-j", "ACCEPT"] for source in sources
              if ipaddress.ip_address(source).version == version]
    rules += [["-A", chain, "-p", "tcp", "-j", "REJECT", "--reject-with", "tcp-reset"],
              ["-I", "INPUT", "-p", "tcp", "--dport", str(port), "-j", chain]]
    return rules


def _undo(port: int, chain: str) -> List[List[str]]:
    return [["-D", "INPUT", "-p", "tcp", "--dport", str(port), "-j", chain], ["-F", chain],
            ["-X", chain]]


def _run(binary: str, arguments: List[str], check: bool) -> None:
    # -w: wait for the lock another program may hold on the tables.
    done = subprocess.run([binary, "-w", *arguments], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise OSError(f"{binary} {' '.join(arguments)}: {done.stderr.strip()}")


def _guard(port: int, chain: str, sources: List[str], watch_fd: int) -> int:
    """The guardian: sets the rules, says so, waits for the node to end, removes them."""
    binaries = _binaries()
    versions = {"iptables": 4, "ip6tables": 6}
    # A Ctrl-C for the node's terminal must not end the guardian before its cleanup.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: os.close(watch_fd))
    set_up = []
    try:
        for name, binary in binaries.items():
            set_up.append(binary)
            for arguments in _rules(port, chain, sources, versions[name]):
                _run(binary, arguments, check=True)
    except OSError as err:
        for binary in set_up:
            for arguments in _undo(port, chain):
                _run(binary, arguments, check=False)
        print(err, file=sys.stderr, flush=True)
        return 1
    print(READY, flush=True)
    try:
        while os.read(watch_fd, 4096):
            pass
    except OSError:
        pass  # closed by SIGTERM
    for binary in set_up:
        for arguments in _undo(port, chain):
            _run(binary, arguments, check=False)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Guards a node's TensorFlow port (internal).")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--chain", required=True)
    parser.add_argument("--watch-fd", type=int, required=True)
    parser.add_argument("--allow", default="")
    args = parser.parse_args(argv)
    return _guard(args.port, args.chain, [a for a in args.allow.split(",") if a],
                  args.watch_fd)


if __name__ == "__main__":
    sys.exit(main())
