"""``autodist probe``: measures the links between the chief and every other node of a resource spec.

For each non-chief node the controller (the machine running ``autodist probe``)
starts this module on the node as a server (``--serve``) and on the chief as a
client (``--measure``), both through the node's launch route
(``launcher.worker_command``: its ``launch_prefix``, SSH, or a local process).
The client connects to the node's spec address and measures, over plain TCP:

* latency: the median round trip of ``pings`` small request/response messages;
* chief -> node and node -> chief throughput: a bulk transfer in each direction,
  measured at the receiver over a window of ``seconds`` from its first byte.

The controller only talks to the two programs through their stdout, so it needs
no route to the cluster itself (an emulated cluster's subnet exists only inside
its namespaces). Nodes are measured one after another, so they never compete
for the chief's link.

A node's bandwidth is the lower of its two directions. The chief gets the
highest of its links' bandwidths: every link runs through the chief's network
interface, so it carries at least that much.

Every subprocess and socket has a timeout; a failure raises ``ProbeError``
naming the node (and the chief, when the chief could not reach it).
"""
import argparse
import collections
import dataclasses
import json
import math
import os
import queue
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Sequence

import yaml

from autodist.cluster import launcher
from autodist.resource_spec import NodeSpec, ResourceSpec
from autodist.usage import check_output_path, options_checked

MODULE = "autodist.cluster.probe"
MAX_SECONDS = 60.0
MAX_PINGS = 1000

_PORT_MARKER = "autodist-probe-port"
_RESULT_MARKER = "autodist-probe-result"
_PING = b"ping".ljust(63, b".") + b"\n"
_CHUNK = 1 << 18
_SEND_GRACE_S = 5.0
"""How long a sender keeps going after the receiver's window should have ended (normally it is reset)."""

_STOP_GRACE_S = 3.0
_MIN_WINDOW_S = 0.05


class ProbeError(RuntimeError):
    """A node could not be probed: its program did not start, answer or reach the other end."""


@dataclasses.dataclass(frozen=True)
class LinkMeasurement:
    """What ``probe`` measured between the chief and one node.

    Attributes:
        address: The node's address.
        latency_ms: Median TCP round trip, in milliseconds.
        to_node_gbit: Throughput from the chief to the node, in Gbit/s.
        from_node_gbit: Throughput from the node to the chief, in Gbit/s.
    """

    address: str
    latency_ms: float
    to_node_gbit: float
    from_node_gbit: float

    @property
    def bandwidth_gbit(self) -> float:
        """float: The lower of the two directions, in Gbit/s."""
        return min(self.to_node_gbit, self.from_node_gbit)


# --- Controller side -------------------------------------------------------------------------------

def probe(spec: ResourceSpec, seconds: float = 1.5, pings: int = 20,
          timeout: float = 30.0) -> list[LinkMeasurement]:
    """Measures the link between the chief and every other node, one node at a time.

    Args:
        spec: The cluster; it needs at least two nodes.
        seconds: Length of each bulk transfer (one per direction), 0 to ``MAX_SECONDS``.
        pings: Number of round trips whose median is the latency, 1 to ``MAX_PINGS``.
        timeout: Bound, in seconds, on starting a program on a node and on any
            single network wait.

    Returns:
        list[LinkMeasurement]: One per non-chief node, in spec order.

    Raises:
        ValueError: If an argument is out of range or the spec has one node.
        ProbeError: Naming the node whose program failed, timed out or could
            not reach the other end.
        launcher.LaunchError: If a node has no route to start a program on.
    """
    check_arguments(seconds, pings, timeout)
    if len(spec.nodes) < 2:
        raise ValueError(f"Resource spec {spec.source!r} has a single node, so there is no link to measure; "
                         "probe a spec with at least two nodes.")
    chief = spec.node(spec.chief)
    return [_measure_link(spec, chief, node, seconds, pings, timeout) for node in spec.nodes if not node.chief]


def check_arguments(seconds: float, pings: int, timeout: float) -> None:
    """Checks the ranges of ``probe``'s arguments (see there), before anything is started.

    Raises:
        ValueError: Naming the first argument out of range and its value.
    """
    if not (_is_number(seconds) and 0 < seconds <= MAX_SECONDS):
        raise ValueError(f"seconds is {seconds!r}, but it must be a number above 0 and at most {MAX_SECONDS}.")
    if not (_is_number(pings) and isinstance(pings, int) and 1 <= pings <= MAX_PINGS):
        raise ValueError(f"pings is {pings!r}, but it must be an integer from 1 to {MAX_PINGS}.")
    # An infinite timeout would let a node that never answers hang the probe.
    if not (_is_number(timeout) and 0 < timeout < math.inf):
        raise ValueError(f"timeout is {timeout!r}, but it must be a positive, finite number of seconds.")


def _is_number(value) -> bool:
    """Whether ``value`` is an int or a float; a bool is not a number here."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def measured_spec(spec: ResourceSpec, measurements: Sequence[LinkMeasurement]) -> dict:
    """Returns the spec as a mapping with ``network_bandwidth`` set from ``measurements``.

    Each measured node gets its bandwidth, the chief the highest of them (see the
    module docstring), all rounded to 3 significant digits; other fields are kept.

    Args:
        spec: The probed spec.
        measurements: The output of ``probe``.

    Returns:
        dict: A mapping ``ResourceSpec.from_dict`` accepts (and a new one each call).
    """
    bandwidth = {m.address: m.bandwidth_gbit for m in measurements}
    if bandwidth:
        bandwidth[spec.chief] = max(bandwidth.values())
    out = spec.to_dict()
    for node in out["nodes"]:
        if node["address"] in bandwidth:
            node["network_bandwidth"] = _round(bandwidth[node["address"]])
    if not out.get("ssh"):
        out.pop("ssh", None)
    return out


def format_table(spec: ResourceSpec, measurements: Sequence[LinkMeasurement]) -> str:
    """Returns a text table of the measurements, one line per node of ``spec``."""
    by_address = {m.address: m for m in measurements}
    width = max(len("node"), *(len(n.address) for n in spec.nodes))
    lines = [f"{'node':<{width}}  {'latency':>10}  {'chief->node':>14}  {'node->chief':>14}  {'bandwidth':>14}"]
    chief_gbit = max((m.bandwidth_gbit for m in measurements), default=math.nan)
    for node in spec.nodes:
        m = by_address.get(node.address)
        if node.chief:
            lines.append(f"{node.address:<{width}}  {'(chief)':>10}  {'':>14}  {'':>14}  "
                         f"{_gbit(chief_gbit):>14}")
        elif m is not None:
            lines.append(f"{node.address:<{width}}  {m.latency_ms:>7.3f} ms  {_gbit(m.to_node_gbit):>14}  "
                         f"{_gbit(m.from_node_gbit):>14}  {_gbit(m.bandwidth_gbit):>14}")
    return "\n".join(lines)


def _measure_link(spec: ResourceSpec, chief: NodeSpec, node: NodeSpec, seconds: float, pings: int,
                  timeout: float) -> LinkMeasurement:
    server = _NodeProgram(spec, node, ["--serve", "0", "--timeout", str(timeout)])
    try:
        port = server.expect(_PORT_MARKER, timeout, f"Node {node.address!r}: the probe server")
        client = _NodeProgram(spec, chief, ["--measure", node.address, port, str(seconds),
                                            "--pings", str(pings), "--timeout", str(timeout)])
        try:
            # Connecting, the pings and each transfer are bounded by ``timeout`` on the chief.
            limit = 4 * timeout + 2 * (seconds + _SEND_GRACE_S)
            text = client.expect(_RESULT_MARKER, limit, f"Node {node.address!r}: the measurement from the chief "
                                                       f"{chief.address!r}")
        finally:
            client.close()
    finally:
        server.close()
    result = json.loads(text)
    return LinkMeasurement(node.address, result["latency_ms"], result["to_node_gbit"], result["from_node_gbit"])


class _NodeProgram:
    """This module running on a node through its launch route; a thread collects its output lines."""

    def __init__(self, spec: ResourceSpec, node: NodeSpec, args: list[str]):
        ssh = spec.ssh_configs.get(node.ssh_config) if node.ssh_config else None
        command = launcher.worker_command(node, ssh, {}, ["-u", "-m", MODULE, *args], os.getcwd())
        self._route = shlex.join(command)
        try:
            process = subprocess.Popen(command, start_new_session=True, stdin=subprocess.DEVNULL,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        except OSError as e:
            raise ProbeError(f"Node {node.address!r}: could not start the probe with {command[0]!r}: {e}") from None
        self._worker = launcher.WorkerProcess(node.address, process, command)
        self._lines: queue.Queue = queue.Queue()
        self._stderr: collections.deque = collections.deque(maxlen=50)
        self._readers = [threading.Thread(target=self._read, args=(process.stdout, self._lines.put), daemon=True),
                         threading.Thread(target=self._read, args=(process.stderr, self._stderr.append),
                                          daemon=True)]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream, put) -> None:
        for line in stream:
            put(line.rstrip("\n"))
        put(None)

    def expect(self, marker: str, timeout: float, who: str) -> str:
        """Returns the rest of the first output line that starts with ``marker``.

        Raises:
            ProbeError: If the program ends first, or ``timeout`` s pass; the
                message starts with ``who`` and quotes the program's last error line.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise ProbeError(f"{who} did not answer within {timeout:g} s (started with '{self._route}')"
                                 f"{self._said()}.") from None
            if line is None:
                try:
                    status = self._worker.process.wait(timeout=_STOP_GRACE_S)
                except subprocess.TimeoutExpired:  # it closed its output but lives on
                    status = "unknown"
                self._readers[1].join(timeout=_STOP_GRACE_S)
                raise ProbeError(f"{who} exited with status {status} (started with '{self._route}')"
                                 f"{self._said()}.")
            if line.startswith(marker + " "):
                return line[len(marker) + 1:]

    def _said(self) -> str:
        errors = [line.strip() for line in self._stderr if line and line.strip()]
        return f"; it said: {errors[-1]}" if errors else ""

    def close(self) -> None:
        """Lets the program end by itself for a moment, then stops its process group."""
        try:
            self._worker.process.wait(timeout=_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self._worker.stop(_STOP_GRACE_S)
        for reader in self._readers:
            reader.join(timeout=_STOP_GRACE_S)


def _round(value: float) -> float:
    return float(f"{value:.3g}")


def _gbit(value: float) -> str:
    return "-" if math.isnan(value) else f"{_round(value):g} Gbit/s"


# --- Node side -------------------------------------------------------------------------------------
# The protocol, on a control connection from the client: lines "ping....\n" (echoed), "recv S\n"
# (the server takes the next data connection from the same host, receives for S s from its first
# byte, closes it and answers "BYTES SECONDS\n"), "send S\n" (the server sends on the next data
# connection until the client closes it, then answers "sent\n") and "quit\n". A receiver closing
# with unread data resets the connection, which is what stops the sender.

def serve(port: int, timeout: float) -> None:
    """Serves one client: prints the port bound, answers its control commands, returns on ``quit``.

    Args:
        port: Port to listen on; 0 picks a free one.
        timeout: Bound, in seconds, on every wait for the client.

    Raises:
        OSError: If the port cannot be bound, or the client is silent for ``timeout`` s.
        ProbeError: If the client sends something outside the protocol.
    """
    with _listen(port) as listener:
        listener.settimeout(timeout)
        print(f"{_PORT_MARKER} {listener.getsockname()[1]}", flush=True)
        ctrl, peer = listener.accept()
        with ctrl, ctrl.makefile("rb") as lines:
            _configure(ctrl, timeout)
            while True:
                line = lines.readline(len(_PING))
                words = line.split()
                if not words or words == [b"quit"]:
                    return
                if line == _PING:
                    ctrl.sendall(_PING)
                elif len(words) == 2 and words[0] in (b"recv", b"send"):
                    seconds = min(MAX_SECONDS, max(_MIN_WINDOW_S, float(words[1])))
                    with _accept_from(listener, _host(peer), timeout) as data:
                        if words[0] == b"recv":
                            received, elapsed = _receive(data, seconds)
                            answer = f"{received} {elapsed!r}\n"
                        else:
                            _send(data, seconds + _SEND_GRACE_S)
                            answer = "sent\n"
                    ctrl.sendall(answer.encode())
                else:
                    raise ProbeError(f"The probe server got {line[:40]!r}, which is not a probe command.")


def measure(host: str, port: int, seconds: float, pings: int, timeout: float) -> dict:
    """Measures the link to a ``serve``-ing node: latency, then a transfer each way.

    Args:
        host: The node's address.
        port: The port its server printed.
        seconds: Receiver window of each transfer.
        pings: Round trips for the latency.
        timeout: Bound, in seconds, on connecting and on every wait.

    Returns:
        dict: ``latency_ms``, ``to_node_gbit`` and ``from_node_gbit``.

    Raises:
        ProbeError: If the node cannot be reached, or a transfer goes wrong.
    """
    ctrl = _connect(host, port, timeout)
    phase = "the pings"
    try:
        with ctrl, ctrl.makefile("rb") as lines:
            rtts = []
            for _ in range(pings):
                start = time.monotonic()
                ctrl.sendall(_PING)
                if lines.readline(len(_PING)) != _PING:
                    raise ProbeError(f"{host}:{port} answered a ping with something else.")
                rtts.append(time.monotonic() - start)

            phase = f"the transfer to {host}"
            ctrl.sendall(f"recv {seconds!r}\n".encode())
            with _connect(host, port, timeout) as data:
                _send(data, seconds + _SEND_GRACE_S)
            received, elapsed = _answer(lines, host, port).split()
            to_node = _rate(int(received), float(elapsed), f"{host} received")

            phase = f"the transfer from {host}"
            ctrl.sendall(f"send {seconds!r}\n".encode())
            with _connect(host, port, timeout) as data:
                from_node = _rate(*_receive(data, seconds), f"the data from {host}")
            if _answer(lines, host, port) != "sent":
                raise ProbeError(f"{host}:{port} did not confirm its transfer.")
            ctrl.sendall(b"quit\n")
    except OSError as e:
        raise ProbeError(f"the connection to {host}:{port} failed during {phase}: "
                         f"{e.strerror or e or type(e).__name__}") from None
    return {"latency_ms": statistics.median(rtts) * 1e3, "to_node_gbit": to_node, "from_node_gbit": from_node}


def _listen(port: int) -> socket.socket:
    """A listening TCP socket on every address of the host, IPv4 and (where possible) IPv6."""
    if socket.has_dualstack_ipv6():
        try:
            return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
        except OSError:  # IPv6 disabled on this host
            pass
    return socket.create_server(("", port))


def _connect(host: str, port: int, timeout: float) -> socket.socket:
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        raise ProbeError(f"could not connect to {host}:{port} within {timeout:g} s: "
                         f"{e.strerror or e or type(e).__name__}") from None
    _configure(sock, timeout)
    return sock


def _configure(sock: socket.socket, timeout: float) -> None:
    sock.settimeout(timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # pings must not wait for Nagle


def _accept_from(listener: socket.socket, host: str, timeout: float) -> socket.socket:
    """Accepts the next connection from ``host``, closing any from elsewhere (within ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        listener.settimeout(max(0.01, deadline - time.monotonic()))
        sock, peer = listener.accept()
        if _host(peer) == host:
            _configure(sock, timeout)
            return sock
        sock.close()


def _host(peer: tuple) -> str:
    """The peer's IP, with an IPv4-mapped IPv6 address (of a dual-stack socket) as plain IPv4."""
    address = peer[0]
    return address[7:] if address.startswith("::ffff:") else address


def _receive(sock: socket.socket, seconds: float) -> tuple[int, float]:
    """Receives for ``seconds`` from the first byte, then closes; returns the bytes and time after that byte."""
    view = memoryview(bytearray(1 << 20))
    if sock.recv_into(view) == 0:
        return 0, 0.0
    first = last = time.monotonic()
    received = 0
    while last - first < seconds:
        n = sock.recv_into(view)
        if n == 0:
            break
        received += n
        last = time.monotonic()
    sock.close()
    return received, last - first


def _send(sock: socket.socket, seconds: float) -> None:
    """Sends for up to ``seconds``; the receiver closing the connection ends it early, as intended."""
    chunk = bytes(_CHUNK)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            sock.sendall(chunk)
    except (ConnectionResetError, BrokenPipeError):
        pass


def _answer(lines, host: str, port: int) -> str:
    line = lines.readline(256)
    if not line.endswith(b"\n"):
        raise ProbeError(f"{host}:{port} closed the control connection in the middle of the probe.")
    return line.decode().strip()


def _rate(received: int, elapsed: float, what: str) -> float:
    if received <= 0 or elapsed < _MIN_WINDOW_S:
        raise ProbeError(f"{what} only {received} bytes in {elapsed:.3f} s, too little to measure a rate.")
    return received * 8 / elapsed / 1e9


# --- Command lines ---------------------------------------------------------------------------------

def add_subcommand(subparsers: argparse._SubParsersAction) -> None:
    """Registers ``autodist probe`` (an entry of ``autodist.cli.SUBCOMMANDS``)."""
    parser = subparsers.add_parser(
        "probe", help="measure the links between the chief and the other nodes of a resource spec",
        description="Runs a small TCP program on each node through its launch route (launch_prefix, ssh or "
                    "locally), measures latency and bandwidth between the chief and every other node, prints "
                    "them and writes each node's network_bandwidth (Gbit/s) into the spec.")
    parser.add_argument("spec", help="path of the resource spec YAML")
    parser.add_argument("--out", help="write the updated spec here instead of overwriting SPEC "
                                      "(the written spec has no comments)")
    parser.add_argument("--seconds", type=float, default=1.5,
                        help="length of the transfer in each direction (default: 1.5)")
    parser.add_argument("--pings", type=int, default=20, help="round trips for the latency median (default: 20)")
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="seconds to wait for a node's program to start or answer (default: 30)")
    parser.add_argument("--report", help="also write the measurements, latencies included, to this JSON file")
    parser.set_defaults(func=_run, usage_parser=parser)


def _run(args: argparse.Namespace) -> int:
    with options_checked():
        check_arguments(args.seconds, args.pings, args.timeout)
        check_output_path(args.out or args.spec, "--out" if args.out else "SPEC")
        if args.report:
            check_output_path(args.report, "--report")
    spec = ResourceSpec(args.spec)
    measurements = probe(spec, args.seconds, args.pings, args.timeout)
    updated = measured_spec(spec, measurements)
    out = args.out or args.spec
    ResourceSpec.from_dict(updated, out)  # never write a spec that would not load
    _write_atomically(out, yaml.safe_dump(updated, sort_keys=False, default_flow_style=None))
    if args.report:
        report = {"spec": out, "chief": spec.chief, "seconds": args.seconds,
                  "nodes": [{**dataclasses.asdict(m), "bandwidth_gbit": m.bandwidth_gbit} for m in measurements]}
        _write_atomically(args.report, json.dumps(report, indent=2) + "\n")
    print(f"Probed {len(measurements)} link(s) from the chief {spec.chief} ({args.seconds:g} s per direction):")
    print(format_table(spec, measurements))
    print(f"Wrote network_bandwidth to {out}" + (f" and the measurements to {args.report}." if args.report else "."))
    return 0


def _write_atomically(path: str, text: str) -> None:
    """Writes through a temporary file, so an interrupted run leaves the old file intact.

    Raises:
        OSError: naming ``path`` (not the temporary file) and the cause.
    """
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as err:
        raise OSError(err.errno, f"cannot write {path}: {err.strerror}") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _node_main(argv: Sequence[str] | None = None) -> int:
    """The program run on the nodes: ``--serve PORT`` or ``--measure HOST PORT SECONDS``."""
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description="Node side of 'autodist probe'.")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--serve", type=int, metavar="PORT", help="serve one client on PORT (0: any free port)")
    mode.add_argument("--measure", nargs=3, metavar=("HOST", "PORT", "SECONDS"),
                      help="measure the link to a server at HOST:PORT with transfers of SECONDS")
    parser.add_argument("--pings", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args(argv)
    try:
        if args.serve is not None:
            serve(args.serve, args.timeout)
        else:
            host, port, seconds = args.measure
            result = measure(host, int(port), float(seconds), args.pings, args.timeout)
            print(f"{_RESULT_MARKER} {json.dumps(result)}", flush=True)
    except (OSError, ValueError, ProbeError) as e:
        print(e if isinstance(e, ProbeError) else f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_node_main())
