"""An emulated multi-host cluster on one machine: network namespaces, a bridge and tc shaping.

``up(n, bandwidth)`` builds, for a cluster named ``ad``:

* a namespace ``ad-br`` holding only a bridge ``br0``, so the private subnet
  ``10.123.0.0/24`` never appears in the root namespace's interfaces or routes;
* per host ``i`` (1-based) a namespace ``ad-h<i>`` with ``lo`` up and an
  interface ``eth0`` (address ``10.123.0.<i>``), one end of a veth pair whose
  other end ``p<i>`` is a port of the bridge;
* a tbf qdisc on ``eth0`` and on ``p<i>``, so the host's link is limited to its
  bandwidth in both directions; hosts may have different bandwidths;
* ``/etc/netns/ad-h<i>/hosts``, which ``ip netns exec`` bind-mounts over
  ``/etc/hosts``, so every host resolves the others as ``h1`` .. ``hN``;
* with a ``memory`` cap, a memory cgroup ``autodist-ad-h<i>`` per host
  (cgroup v1's memory controller, or cgroup v2, mounted at ``CGROUP_MOUNT``),
  which the host's launch prefix enters before the namespace: all its
  processes together get the cap, and the kernel's out-of-memory killer stops
  one that would exceed it (``oom_kills`` counts them).

``spec_dict`` turns the cluster into a resource spec whose nodes carry
``launch_prefix: [ip, netns, exec, ad-h<i>]``, so AutoDist starts each node's
process inside its namespace and a multi-host job runs over real, shaped links,
and, with a cap, ``memory``, so AutoDist refuses a strategy that cannot fit.
``down`` removes all of it. Everything needs root.

Note:
    Only processes started inside the namespaces can reach the cluster: the
    root namespace has no route to the subnet, by design. Run the training
    script (the chief) with the chief's prefix, e.g. ``ip netns exec ad-h1 python
    train.py``.
"""

import contextlib
import dataclasses
import math
import os
import re
import shlex
import shutil
import subprocess
import time
from typing import Iterator, Sequence

from autodist.resource_spec import parse_memory

SUBNET = "10.123.0"
"""First three octets of the cluster subnet (a /24 that exists only inside the namespaces)."""

PREFIX_LEN = 24
MAX_NODES = 253
NETNS_ETC = "/etc/netns"
"""Directory whose ``<namespace>/`` entries ``ip netns exec`` bind-mounts over ``/etc``."""

BRIDGE = "br0"
HOST_IFACE = "eth0"

TBF_QUEUE = "25ms"
"""tbf ``latency``: the longest a packet may wait in the shaper's queue before being dropped."""

_BURST_SECONDS = 0.005
_MIN_BURST_BYTES = 16 * 1024
_COMMAND_TIMEOUT_S = 30

_NAME_RE = re.compile(r"[A-Za-z0-9_]{1,32}")
_CGROUP_PREFIX = "autodist-"
_CGROUP_REMOVAL_S = 10.0

CGROUP_MOUNT = "/run/autodist/memory"
"""Where a capped cluster mounts the memory cgroup hierarchy: outside ``/sys``,
which ``ip netns exec`` remounts, so that a launch prefix run inside another
host's namespace (the chief starting a worker) still finds the groups."""
_RATE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]+)\s*")
_LATENCY_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(us|usec|ms|msec|s|sec|secs)\s*")

# tc's rate units: "bit" ones count bits, "bps" ones count bytes; SI or IEC prefixes.
_PREFIX = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
           "ki": 2 ** 10, "mi": 2 ** 20, "gi": 2 ** 30, "ti": 2 ** 40}
_RATE_UNITS = {p + "bit": f for p, f in _PREFIX.items()}
_RATE_UNITS.update({p + "bps": 8 * f for p, f in _PREFIX.items()})


class EmulationError(RuntimeError):
    """Raised when an emulated cluster cannot be built, used or removed."""


class CommandError(EmulationError):
    """A command run to build or remove the cluster failed.

    Attributes:
        argv: The command.
        returncode: Its exit status.
        stderr: What it wrote to stderr.
    """

    def __init__(self, argv: Sequence[str], returncode: int, stderr: str):
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr.strip()
        super().__init__(f"Command '{shlex.join(self.argv)}' failed with exit status {returncode}: "
                         f"{self.stderr or '(no stderr)'}")


@dataclasses.dataclass(frozen=True)
class EmulatedHost:
    """One host of an emulated cluster.

    Attributes:
        name: Host name the other hosts resolve (``h1`` .. ``hN``).
        namespace: Its network namespace (``<cluster>-h<i>``).
        address: Its IPv4 address on the cluster subnet.
        bandwidth_gbit: Rate of its link, each direction, in Gbit/s.
        num_cpus: CPU replicas it gets in the resource spec.
        memory_bytes: The memory cap of all its processes together, or None.
        cgroup: The directory of its memory cgroup, or None without a cap.
    """

    name: str
    namespace: str
    address: str
    bandwidth_gbit: float
    num_cpus: int = 1
    memory_bytes: int | None = None
    cgroup: str | None = None

    @property
    def launch_prefix(self) -> list[str]:
        """list[str]: The command prefix that runs a program on this host."""
        netns = ["ip", "netns", "exec", self.namespace]
        if self.cgroup is None:
            return netns
        # The shell moves itself into the cgroup ($0), then becomes the command.
        return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', self.cgroup, *netns]


@dataclasses.dataclass(frozen=True)
class EmulatedCluster:
    """An emulated cluster built by ``up``; the first host is the chief.

    Attributes:
        name: The cluster name (the prefix of its namespaces).
        hosts: The hosts, in order.
        latency: One-way delay added to each host's outgoing traffic (tc
            syntax, e.g. ``"1ms"``), or None.
    """

    name: str
    hosts: tuple[EmulatedHost, ...]
    latency: str | None = None

    @property
    def bridge_namespace(self) -> str:
        """str: The namespace holding the bridge."""
        return _bridge_namespace(self.name)


def parse_rate(rate: str | float | int) -> float:
    """Converts a tc rate such as ``"1gbit"``, ``"500mbit"`` or ``"2.5gbit"`` to Gbit/s.

    Units follow tc: ``bit``, ``kbit``, ``mbit``, ``gbit``, ``tbit`` (and IEC
    ``kibit`` ...) count bits per second; ``bps``, ``kbps``, ``mbps`` ... count
    *bytes* per second. Case is ignored. A plain number is taken as Gbit/s.

    Args:
        rate: The rate.

    Returns:
        float: The rate in Gbit/s.

    Raises:
        ValueError: If ``rate`` is not a positive rate of at least 1 kbit/s.
    """
    if isinstance(rate, (int, float)) and not isinstance(rate, bool):
        gbit = float(rate)
    else:
        m = _RATE_RE.fullmatch(rate.lower()) if isinstance(rate, str) else None
        if m is None or m.group(2) not in _RATE_UNITS:
            raise ValueError(f"Bandwidth {rate!r} is not a rate in tc syntax; write a number and a unit, "
                             f"e.g. '1gbit', '500mbit' or '2.5gbit' (units: {sorted(_RATE_UNITS)}).")
        gbit = float(m.group(1)) * _RATE_UNITS[m.group(2)] / 1e9
    if not math.isfinite(gbit) or gbit < 1e-6:
        raise ValueError(f"Bandwidth {rate!r} is too low or not finite; it must be at least 1kbit "
                         "(e.g. '100mbit').")
    return gbit


def oom_kills(host: EmulatedHost) -> int:
    """How many processes of ``host`` the kernel killed for exceeding its memory cap (0 without one)."""
    if host.cgroup is None:
        return 0
    with open(os.path.join(host.cgroup, _memory_hierarchy().events), encoding="utf-8") as f:
        counts = dict(line.split() for line in f if line.strip())
    return int(counts.get("oom_kill", 0))


def up(num_nodes: int, bandwidth: str | float | Sequence[str | float] = "1gbit", name: str = "ad",
       cpus_per_node: int | Sequence[int] = 1, latency: str | None = None,
       memory: str | int | Sequence[str | int] | None = None) -> EmulatedCluster:
    """Builds an emulated cluster (see the module docstring for its layout).

    On any failure the pieces built so far are removed before the error propagates.

    Args:
        num_nodes: Number of hosts, 1 to ``MAX_NODES``.
        bandwidth: The link rate of every host (tc syntax, or Gbit/s), or a
            sequence with one rate per host.
        name: Cluster name, the prefix of its namespaces (letters, digits, ``_``).
        cpus_per_node: CPU replicas per host in the resource spec, or one count per host.
        latency: One-way delay added to each host's outgoing traffic (e.g.
            ``"1ms"``), so two hosts see a round trip of twice that. Needs the
            kernel's ``sch_netem``.
        memory: The memory cap of each host's processes together (``"3g"``,
            bytes), or one per host; None for none. Needs a memory cgroup
            controller (cgroup v1 or v2).

    Returns:
        EmulatedCluster: The cluster.

    Raises:
        ValueError: If an argument is invalid.
        EmulationError: If not root, ``ip``/``tc`` are missing, a cluster of that
            name exists, latency emulation or memory cgroups are unavailable,
            or a command fails.
    """
    rates, cpus, caps = check_arguments(num_nodes, bandwidth, name, cpus_per_node, latency, memory)
    _require_root()
    hierarchy = _memory_hierarchy() if memory is not None else None
    if memory is not None and hierarchy is None:
        raise EmulationError(
            f"A memory cap (memory={memory!r}) needs a memory cgroup controller, and this machine "
            "mounts none (no cgroup v1 'memory' hierarchy, no cgroup v2 with 'memory' in "
            "cgroup.controllers). Leave out the cap, or mount the controller.")
    existing = _cluster_namespaces(name)
    if existing:
        raise EmulationError(
            f"Emulated cluster {name!r} already exists (namespaces {existing}). Remove it first with "
            f"'autodist emulate down --name {name}' (or emulate.down({name!r})), or pick another name.")
    cluster = EmulatedCluster(name, tuple(
        EmulatedHost(f"h{i}", f"{name}-h{i}", f"{SUBNET}.{i}", rate, n, cap,
                     None if cap is None else _cgroup_path(f"{name}-h{i}"))
        for i, (rate, n, cap) in enumerate(zip(rates, cpus, caps), start=1)), latency)
    try:
        _build(cluster, hierarchy)
    except BaseException:
        with contextlib.suppress(EmulationError):  # keep the original error
            down(name)
        raise
    return cluster


def down(name: str = "ad") -> list[str]:
    """Removes an emulated cluster: its namespaces (with their veths and bridge), ``/etc/netns``
    entries and memory cgroups.

    Pieces already gone are skipped, so calling it twice, or on a half-built
    cluster, is fine. Processes still running inside a namespace keep running
    (detached from the name, and moved out of their memory cgroup) until they exit.

    Args:
        name: The cluster name given to ``up``.

    Returns:
        list[str]: The namespaces removed.

    Raises:
        ValueError: If ``name`` is not a valid cluster name.
        EmulationError: If not root, or a namespace or memory cgroup exists but cannot be
            deleted.
    """
    check_name(name)
    _require_root()
    removed = []
    for ns in _cluster_namespaces(name):
        try:
            _run([_tool("ip"), "netns", "delete", ns])
        except CommandError:
            if ns in _namespaces():
                raise
        else:
            removed.append(ns)
    if os.path.isdir(NETNS_ETC):
        for entry in os.listdir(NETNS_ETC):
            if _is_ours(name, entry):
                shutil.rmtree(os.path.join(NETNS_ETC, entry), ignore_errors=True)
        with contextlib.suppress(OSError):  # only succeeds when nothing else is configured there
            os.rmdir(NETNS_ETC)
    _remove_cgroups(name)
    return removed


def spec_dict(cluster: EmulatedCluster) -> dict:
    """Returns a resource spec mapping for the cluster (``ResourceSpec.from_dict`` accepts it).

    Node ``i`` has the host's IP as ``address``, CPUs ``[0 .. k-1]``, its
    bandwidth as ``network_bandwidth`` (Gbit/s), the host's ``launch_prefix``
    and, when capped, its cap as ``memory`` (bytes); the first node is the chief.

    Args:
        cluster: A cluster from ``up``.

    Returns:
        dict: ``{"nodes": [...]}`` in the layout of the YAML resource spec.
    """
    nodes = []
    for i, host in enumerate(cluster.hosts):
        node = {"address": host.address, "cpus": list(range(host.num_cpus))}
        if i == 0:
            node["chief"] = True
        node["network_bandwidth"] = host.bandwidth_gbit
        node["launch_prefix"] = host.launch_prefix
        if host.memory_bytes is not None:
            node["memory"] = host.memory_bytes
        nodes.append(node)
    return {"nodes": nodes}


@contextlib.contextmanager
def emulated_cluster(num_nodes: int, bandwidth: str | float | Sequence[str | float] = "1gbit",
                     name: str = "ad", cpus_per_node: int | Sequence[int] = 1,
                     latency: str | None = None,
                     memory: str | int | Sequence[str | int] | None = None) -> Iterator[EmulatedCluster]:
    """Context manager around ``up``/``down``: the cluster is removed on exit, even after an error.

    Args:
        num_nodes, bandwidth, name, cpus_per_node, latency, memory: As for ``up``.

    Yields:
        EmulatedCluster: The cluster.
    """
    cluster = up(num_nodes, bandwidth, name, cpus_per_node, latency, memory)
    try:
        yield cluster
    finally:
        down(name)


def check_arguments(num_nodes, bandwidth, name, cpus_per_node, latency,
                    memory=None) -> tuple[list[float], list[int], list[int | None]]:
    """Checks ``up``'s arguments (see there) without touching anything.

    Returns:
        tuple: The per-host rates (Gbit/s), CPU counts and memory caps (bytes or None).

    Raises:
        ValueError: Naming the first argument out of range and its value.
    """
    check_name(name)
    if not isinstance(num_nodes, int) or isinstance(num_nodes, bool) or not 1 <= num_nodes <= MAX_NODES:
        raise ValueError(f"num_nodes is {num_nodes!r}, but it must be an integer from 1 to {MAX_NODES}.")
    rates = [parse_rate(r) for r in _per_node(bandwidth, num_nodes, "bandwidth", (str, int, float))]
    cpus = _per_node(cpus_per_node, num_nodes, "cpus_per_node", (int,))
    bad = [c for c in cpus if isinstance(c, bool) or c < 1]
    if bad:
        raise ValueError(f"cpus_per_node is {cpus_per_node!r}, but every count must be a positive integer.")
    if latency is not None and (not isinstance(latency, str) or not _LATENCY_RE.fullmatch(latency)):
        raise ValueError(f"latency is {latency!r}, but it must be a delay in tc syntax, e.g. '1ms' or '500us'.")
    caps = ([None] * num_nodes if memory is None
            else [parse_memory(m) for m in _per_node(memory, num_nodes, "memory", (str, int))])
    return rates, cpus, caps


def _per_node(value, num_nodes: int, what: str, scalar: tuple[type, ...]) -> list:
    """Expands a scalar to one value per node, or checks a sequence has one per node."""
    if isinstance(value, scalar):
        return [value] * num_nodes
    values = list(value) if isinstance(value, (list, tuple)) else None
    if values is None or not all(isinstance(v, scalar) for v in values):
        raise ValueError(f"{what} is {value!r}, but it must be one value or a list with one value per node.")
    if len(values) == 1:
        return values * num_nodes
    if len(values) != num_nodes:
        raise ValueError(f"{what} lists {len(values)} values {values}, but the cluster has {num_nodes} "
                         "nodes. Give one value for all nodes or exactly one per node.")
    return values


def check_name(name: str) -> None:
    """Raises ``ValueError`` unless ``name`` is a valid cluster name."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(f"Cluster name {name!r} is invalid; use 1 to 32 letters, digits or '_', e.g. 'ad'.")


def _build(cluster: EmulatedCluster, hierarchy: "_MemoryHierarchy | None") -> None:
    ip, tc = _tool("ip"), _tool("tc")
    br = cluster.bridge_namespace
    _run([ip, "netns", "add", br])
    _run([ip, "-n", br, "link", "set", "lo", "up"])
    _run([ip, "-n", br, "link", "add", BRIDGE, "type", "bridge"])
    _run([ip, "-n", br, "link", "set", BRIDGE, "up"])
    if cluster.latency is not None:
        _probe_netem(tc, br, cluster.latency)
    for i, host in enumerate(cluster.hosts, start=1):
        ns, port = host.namespace, f"p{i}"
        _run([ip, "netns", "add", ns])
        _run([ip, "-n", ns, "link", "set", "lo", "up"])
        # Created directly inside the two namespaces: the root namespace never sees them.
        _run([ip, "link", "add", HOST_IFACE, "netns", ns, "type", "veth", "peer", "name", port, "netns", br])
        _run([ip, "-n", br, "link", "set", port, "master", BRIDGE])
        _run([ip, "-n", br, "link", "set", port, "up"])
        _run([ip, "-n", ns, "addr", "add", f"{host.address}/{PREFIX_LEN}", "dev", HOST_IFACE])
        _run([ip, "-n", ns, "link", "set", HOST_IFACE, "up"])
        _shape(tc, ns, HOST_IFACE, host.bandwidth_gbit, cluster.latency)
        _shape(tc, br, port, host.bandwidth_gbit, None)
        if host.cgroup is not None:
            _make_cgroup(host, hierarchy)
    _write_hosts_files(cluster)


def _shape(tc: str, ns: str, dev: str, gbit: float, latency: str | None) -> None:
    """Limits egress of ``dev`` to ``gbit`` with tbf, plus a netem delay under it if ``latency``."""
    bits = round(gbit * 1e9)
    # tbf needs a bucket of a few packets at least; at high rates, a few ms of traffic
    # so timer slack between dequeues does not cap the rate below the target.
    burst = max(_MIN_BURST_BYTES, round(bits / 8 * _BURST_SECONDS))
    _run([tc, "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf",
          "rate", f"{bits}bit", "burst", str(burst), "latency", TBF_QUEUE])
    if latency is not None:
        _run([tc, "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "netem",
              "delay", latency])


def _probe_netem(tc: str, ns: str, latency: str) -> None:
    """Tries a netem qdisc on ``lo`` of ``ns`` (then removes it); raises if the kernel lacks netem."""
    try:
        _run([tc, "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", latency])
    except CommandError as e:
        raise EmulationError(
            f"Latency emulation (latency={latency!r}) needs the kernel's sch_netem qdisc, which this "
            f"kernel lacks or cannot load (tc said: {e.stderr or e}). Leave out the latency, or use a "
            "kernel built with CONFIG_NET_SCH_NETEM.") from e
    _run([tc, "-n", ns, "qdisc", "del", "dev", "lo", "root"])


@dataclasses.dataclass(frozen=True)
class _MemoryHierarchy:
    """The machine's memory cgroup hierarchy (cgroup v1 or v2): how to mount it, its files' names."""

    mount_options: tuple  # ``mount`` options naming the hierarchy
    limit: str            # the cap, in bytes
    swap_limit: str       # memory plus swap (v1) or swap alone (v2): kept from extending the cap
    swap_value: str       # what ``swap_limit`` gets, "{cap}" standing for the cap
    events: str           # holds an ``oom_kill <count>`` line


_V1 = _MemoryHierarchy(("-t", "cgroup", "-o", "memory"), "memory.limit_in_bytes",
                       "memory.memsw.limit_in_bytes", "{cap}", "memory.oom_control")
_V2 = _MemoryHierarchy(("-t", "cgroup2"), "memory.max", "memory.swap.max", "0", "memory.events")


def _mounts() -> list:
    """(mount point, file system type, options) of each mount."""
    with open("/proc/self/mounts", encoding="utf-8") as f:
        return [tuple(line.split()[1:4]) for line in f if line.strip()]


def _memory_hierarchy() -> _MemoryHierarchy | None:
    """The memory cgroup hierarchy this machine mounts (v1's ``memory`` one first), or None."""
    mounts = _mounts()
    if any(kind == "cgroup" and "memory" in options.split(",") for _, kind, options in mounts):
        return _V1
    for point, kind, _ in mounts:
        controllers = os.path.join(point, "cgroup.controllers")
        if kind == "cgroup2" and os.path.exists(controllers):
            with open(controllers, encoding="utf-8") as f:
                if "memory" in f.read().split():
                    return _V2
    return None


def _cgroup_path(namespace: str) -> str:
    return os.path.join(CGROUP_MOUNT, f"{_CGROUP_PREFIX}{namespace}")


def _mount_hierarchy(hierarchy: _MemoryHierarchy) -> None:
    """Mounts the memory hierarchy at ``CGROUP_MOUNT``, unless it is there."""
    if any(point == CGROUP_MOUNT for point, _, _ in _mounts()):
        return
    os.makedirs(CGROUP_MOUNT, exist_ok=True)
    _run([_tool("mount"), *hierarchy.mount_options, "autodist", CGROUP_MOUNT])


def _make_cgroup(host: EmulatedHost, hierarchy: _MemoryHierarchy) -> None:
    try:
        _mount_hierarchy(hierarchy)
        os.makedirs(host.cgroup, exist_ok=True)
        _write(os.path.join(host.cgroup, hierarchy.limit), str(host.memory_bytes))
        swap = os.path.join(host.cgroup, hierarchy.swap_limit)
        if os.path.exists(swap):  # absent when the kernel does not account swap
            _write(swap, hierarchy.swap_value.format(cap=host.memory_bytes))
    except (OSError, CommandError) as e:
        raise EmulationError(f"Could not cap {host.name}'s memory at {host.memory_bytes} bytes in "
                             f"cgroup {host.cgroup}: {e}") from e


def _remove_cgroups(name: str) -> None:
    """Removes the cluster's memory cgroups, and the hierarchy's mount once no cluster has one.

    Processes still in a group move to the hierarchy's root group (and keep
    running, as they do when their namespace is removed); one that is exiting
    cannot move, so removal waits for it a little.
    """
    if not any(point == CGROUP_MOUNT for point, _, _ in _mounts()):
        return
    ours = [entry for entry in os.listdir(CGROUP_MOUNT) if entry.startswith(_CGROUP_PREFIX)]
    for entry in list(ours):
        if not _is_ours(name, entry[len(_CGROUP_PREFIX):]):
            continue
        path = os.path.join(CGROUP_MOUNT, entry)
        deadline = time.monotonic() + _CGROUP_REMOVAL_S
        while True:
            with open(os.path.join(path, "cgroup.procs"), encoding="utf-8") as f:
                pids = f.read().split()
            for pid in pids:
                with contextlib.suppress(OSError):  # it may have exited meanwhile
                    _write(os.path.join(CGROUP_MOUNT, "cgroup.procs"), pid)
            try:
                os.rmdir(path)
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise EmulationError(f"Could not remove memory cgroup {path} (processes {pids} "
                                         f"were in it): {e}") from e
                time.sleep(0.1)
        ours.remove(entry)
    if not ours:
        with contextlib.suppress(CommandError, OSError):  # busy: another user of the mount
            _run([_tool("umount"), CGROUP_MOUNT])
            os.removedirs(CGROUP_MOUNT)  # and /run/autodist, when empty


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _write_hosts_files(cluster: EmulatedCluster) -> None:
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
    lines += [f"{h.address}\t{h.name} {h.namespace}" for h in cluster.hosts]
    text = "\n".join(lines) + "\n"
    for host in cluster.hosts:
        directory = os.path.join(NETNS_ETC, host.namespace)
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "hosts"), "w", encoding="utf-8") as f:
            f.write(text)


def _bridge_namespace(name: str) -> str:
    return f"{name}-br"


def _is_ours(name: str, namespace: str) -> bool:
    return namespace == _bridge_namespace(name) or re.fullmatch(rf"{re.escape(name)}-h\d+", namespace) is not None


def _cluster_namespaces(name: str) -> list[str]:
    return [ns for ns in _namespaces() if _is_ours(name, ns)]


def _namespaces() -> list[str]:
    """Names from ``ip netns list`` (lines such as ``ad-h1 (id: 3)``)."""
    out = _run([_tool("ip"), "netns", "list"]).stdout
    return sorted(line.split()[0] for line in out.splitlines() if line.strip())


def _require_root() -> None:
    if os.geteuid() != 0:
        raise EmulationError("Emulated clusters need root (they create network namespaces, veth pairs and "
                             "tc qdiscs); run the command as root, e.g. with sudo.")


def _tool(name: str) -> str:
    """Finds a system binary, also in the sbin directories a non-login PATH may lack."""
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/local/sbin")
    if found is None:
        package = "util-linux" if name in ("mount", "umount") else "iproute2"
        raise EmulationError(f"Emulated clusters need {package}'s '{name}' command, which was not found; "
                             f"install {package} (e.g. 'apt-get install {package}').")
    return found


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    """Runs a command; raises ``CommandError`` (with the command and its stderr) if it fails."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as e:
        raise CommandError(argv, -1, f"timed out after {_COMMAND_TIMEOUT_S} s") from e
    except OSError as e:
        raise CommandError(argv, -1, str(e)) from e
    if proc.returncode != 0:
        raise CommandError(argv, proc.returncode, proc.stderr)
    return proc
