"""Runs one node's part of a multi-node job: roles, TensorFlow servers, the coordinator.

Every node runs the same user script. The chief (started by the user) builds the
strategy, serves it, and launches the script on the other nodes with the job's
coordinates in the environment; a process started that way is a worker. Each
node starts its TensorFlow server (task ``i`` of job ``worker``, in spec order
with the chief first) and rewrites its own part of the graph.
"""
from __future__ import annotations

import atexit
import ctypes
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, Optional, Tuple

import tensorflow as tf

from autodist.cluster import firewall, launcher
from autodist.cluster.service import (
    TOKEN_ENV, NodeState, ServiceError, StrategyClient, StrategyServer, TrainingEnd,
    WorkerFailedError, new_token)
from autodist.resource_spec import ResourceSpec, ResourceSpecError

WORKER_ENV = "AUTODIST_WORKER"            # this process is the worker for that node address
CHIEF_ENV = "AUTODIST_CHIEF"              # the chief's address
SERVICE_PORT_ENV = "AUTODIST_SERVICE_PORT"
TF_PORT_ENV = "AUTODIST_TF_PORT"          # port of every node's TensorFlow server
DEFAULT_TF_PORT = 15470
WORKER_EXIT_GRACE_S = 60.0
CHIEF_LOST_S = 30.0                       # a worker exits once its chief is silent this long
# How long the chief, failing because a node stopped training early, gives that node
# (which waits to hear whether the others stopped too) to say so itself before the
# chief stops it.
TELL_STOPPED_S = 3.0
_POLL_S = 0.2
JOB = "worker"


@dataclasses.dataclass(frozen=True)
class NodeRole:
    """Who this process is in the job.

    Attributes:
        service: a worker's: the chief's strategy service (address, port).
    """

    address: str
    is_chief: bool
    task_index: int
    service: Optional[Tuple[str, int]] = None


def current_role(spec: ResourceSpec) -> NodeRole:
    """The chief unless launched as a worker (``AUTODIST_WORKER`` set).

    A worker's chief sets ``AUTODIST_CHIEF`` (its address) and
    ``AUTODIST_SERVICE_PORT`` (where it serves the strategy) too.

    Raises:
        ValueError: naming the variable and its value (cut short) when
            ``AUTODIST_WORKER`` names a node the spec lacks, or a worker's
            ``AUTODIST_CHIEF`` or ``AUTODIST_SERVICE_PORT`` is unset or wrong.
    """
    address = os.environ.get(WORKER_ENV, spec.chief)
    order = ordered_nodes(spec)
    if address not in order:
        raise ValueError(f"{WORKER_ENV}={address[:100]!r} is not a node of the resource spec "
                         f"'{spec.source}' ({str(order)[:300]}).")
    if address == spec.chief:
        return NodeRole(address, True, 0)
    launched_by = (f"{WORKER_ENV}={address!r} makes this process a worker, which its chief "
                   f"starts with {CHIEF_ENV} and {SERVICE_PORT_ENV} set; unset {WORKER_ENV} "
                   "to run the script as the chief.")
    chief = os.environ.get(CHIEF_ENV)
    if chief is None:
        raise ValueError(f"{CHIEF_ENV} is not set. {launched_by}")
    if chief != spec.chief:
        raise ValueError(f"{CHIEF_ENV}={chief[:100]!r} is not the chief of the resource spec "
                         f"'{spec.source}' ({spec.chief!r}). {launched_by}")
    port = _port(SERVICE_PORT_ENV, os.environ.get(SERVICE_PORT_ENV), launched_by)
    return NodeRole(address, False, order.index(address), service=(chief, port))


def ordered_nodes(spec: ResourceSpec) -> list:
    """Node addresses with the chief first: the order of TensorFlow tasks."""
    return [spec.chief] + [a for a in spec.node_addresses if a != spec.chief]


def tf_port() -> int:
    """The TensorFlow servers' port: ``AUTODIST_TF_PORT`` or 15470.

    Raises:
        ValueError: when the variable is not a port number from 1 to 65535.
    """
    return _port(TF_PORT_ENV, os.environ.get(TF_PORT_ENV, str(DEFAULT_TF_PORT)),
                 f"set it to an integer from 1 to 65535 (default {DEFAULT_TF_PORT}).")


def _port(name: str, text: Optional[str], hint: str) -> int:
    """``text``, the value of environment variable ``name``, as a port number.

    Raises:
        ValueError: naming the variable, its value (cut short) and ``hint``, when
            it is unset or not an integer from 1 to 65535.
    """
    try:
        port = int(text)
    except (TypeError, ValueError):  # unset, or not a number
        port = 0
    if not 1 <= port <= 65535:
        state = " is not set" if text is None else f"={text[:40]!r} is not a port"
        raise ValueError(f"{name}{state}: {hint}")
    return port


def check_this_node(spec: ResourceSpec, role: NodeRole) -> None:
    """Refuses a spec this process cannot run as ``role``, saying why.

    On a cluster the chief must be this machine and no two nodes may be it (their
    servers would share a port); ssh keys must exist where the chief reads them.
    A node's GPUs must exist on it. A process joins one multi-node job
    (``check_no_job_joined``).

    Raises:
        ResourceSpecError: naming the node, the field and the value.
        RuntimeError: on a cluster, when this process already joined a multi-node job.
    """
    node = spec.node(role.address)
    if node.gpus:
        have = len(tf.config.list_physical_devices("GPU"))
        if max(node.gpus) >= have:
            raise ResourceSpecError(
                f"Resource spec {spec.source!r}: node {role.address!r} lists gpus "
                f"{list(node.gpus)}, but this machine has {have} GPU(s). List only the GPUs it "
                "has, or omit 'gpus' to train on its CPUs.")
    if len(spec.nodes) == 1:
        return
    tf_port()  # a bad AUTODIST_TF_PORT is named before anything starts
    check_no_job_joined()
    _check_names_resolve(spec, role)
    if not role.is_chief:
        return
    local = [address for address in spec.node_addresses if _is_this_machine(address)]
    if role.address not in local:
        raise ResourceSpecError(
            f"Resource spec {spec.source!r}: the chief is {role.address!r}, which is not an "
            "address of this machine. Run the script on the chief, or mark this machine's "
            "node 'chief: true'.")
    if len(local) > 1:
        raise ResourceSpecError(
            f"Resource spec {spec.source!r}: nodes {local} are all this machine, whose "
            "TensorFlow servers would share one port. List each machine once; give it several "
            "replicas with 'cpus' or 'gpus'.")
    for address in spec.node_addresses:
        entry = spec.node(address).ssh_config
        key = spec.ssh_configs[entry].key_file if entry else None
        if key and not os.path.isfile(os.path.expanduser(key)):
            raise ResourceSpecError(
                f"Resource spec {spec.source!r}: ssh entry {entry!r} (node {address!r}) has "
                f"key_file {key[:200]!r}, which does not exist on the chief. Fix the path or "
                "create the key.")


# The node this process joined a multi-node job as. A process joins one, for as long as
# it lives (the TensorFlow server it starts does), so this is process-wide too.
_joined_as: Optional[NodeRole] = None


def check_no_job_joined() -> None:
    """Refuses a second multi-node job in this process, before any of it starts.

    TensorFlow cannot stop a node's server before its process ends, and every
    worker runs the whole script: workers launched for a second job would run
    the first job's code as well.

    Raises:
        RuntimeError: naming the node this process joined a job as, and saying to
            start each multi-node job in a new process.
    """
    if _joined_as is None:
        return
    node = f"{_joined_as.address!r}, {'the chief' if _joined_as.is_chief else 'a worker'}"
    raise RuntimeError(
        f"AutoDist: this process already joined a multi-node job (as node {node}), and a "
        "process joins one: TensorFlow cannot stop a node's server before its process ends. "
        "Start each multi-node job in a new process, a run of the script of its own (in a "
        "notebook, restart the kernel first).")


def _join_job(role: NodeRole) -> None:
    """Records that this process joins a multi-node job as ``role``, refusing a second."""
    global _joined_as
    check_no_job_joined()
    _joined_as = role


def _check_names_resolve(spec: ResourceSpec, role: NodeRole) -> None:
    """Refuses a spec naming a node this machine cannot resolve: its port rules would leave
    that node out, and its server could not reach it.

    Raises:
        ResourceSpecError: naming this node, the name and the fix.
    """
    for address in spec.node_addresses:
        try:
            socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
        except OSError as err:
            this = "the chief" if role.is_chief else "a worker"
            raise ResourceSpecError(
                f"Resource spec {spec.source!r}: node {role.address!r} ({this}, this machine) "
                f"cannot resolve the address {address!r} of node {address!r} "
                f"({err.strerror or err}). Add {address!r} to this machine's /etc/hosts or "
                "its DNS, or give the node's IP address in the spec.") from None


def _is_this_machine(address: str) -> bool:
    """Whether a socket of this process can bind ``address``: it is one of this machine's."""
    try:
        infos = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.bind((sockaddr[0], 0))
                return True
        except OSError:
            continue
    return False


def tf_devices(spec: ResourceSpec) -> dict:
    """Strategy device string -> TensorFlow device name, for every device of the cluster."""
    order = ordered_nodes(spec)
    devices = spec.cpu_devices + spec.replica_devices
    return {d.name_string(): f"/job:{JOB}/replica:0/task:{order.index(d.host_address)}"
                             f"/device:{d.device_type}:{d.device_index}" for d in devices}


def session_config(base: tf.compat.v1.ConfigProto) -> tf.compat.v1.ConfigProto:
    """A node's server and session config: ``base`` plus the collective group leader."""
    config = tf.compat.v1.ConfigProto()
    config.CopyFrom(base)
    config.experimental.collective_group_leader = f"/job:{JOB}/replica:0/task:0"
    return config


def start_tf_server(spec: ResourceSpec, role: NodeRole,
                    config: tf.compat.v1.ConfigProto) -> tf.distribute.Server:
    """Starts this node's TensorFlow server.

    Only the spec's nodes may connect to it (``firewall.protect_tf_port``).

    Raises:
        RuntimeError: naming the address when the port is taken, or when the
            rules admitting only the spec's nodes could not be set.
    """
    port = tf_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # As gRPC does: connections of a finished job lingering in TIME_WAIT don't count.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as err:
            holder = _listener_of(port)
            if holder is not None and holder[0] == os.getpid():
                raise RuntimeError(
                    f"Node '{role.address}' cannot start its TensorFlow server: this process "
                    f"already runs one on port {port}, started by an earlier AutoDist on a "
                    "cluster. TensorFlow cannot stop a server before its process ends, so a "
                    "process runs one multi-node job: start the next job in a new process.") \
                    from None
            if holder is not None:
                raise RuntimeError(
                    f"Node '{role.address}' cannot start its TensorFlow server: port {port} is "
                    f"held by process {holder[0]} ({holder[1][:200]}): another job runs on "
                    f"this node. Wait until it ends, or give this job another {TF_PORT_ENV}.") \
                    from None
            raise RuntimeError(
                f"Node '{role.address}' cannot start its TensorFlow server: port {port} is "
                f"already in use ({err.strerror}). Free it or set {TF_PORT_ENV}.") from None
    firewall.protect_tf_port(port, spec.node_addresses)
    cluster = tf.train.ClusterSpec({JOB: [f"{a}:{port}" for a in ordered_nodes(spec)]})
    return tf.distribute.Server(cluster, job_name=JOB, task_index=role.task_index,
                                config=config, start=True)


def _listener_of(port: int) -> Optional[Tuple[int, str]]:
    """The process listening on TCP ``port``: (its id, its command line), or None where
    Linux's /proc does not tell (another user's process, another system)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            # local address "ADDR:PORT" in hex, state 0A = LISTEN, inode in column 10
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    # This process first: a server of its own is the likeliest.
    pids = [str(os.getpid())] + [p for p in _listdir("/proc") if p.isdigit()]
    for pid in pids:
        for fd in _listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") not in inodes:
                    continue
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    command = " ".join(f.read().replace(b"\0", b" ").decode(
                        errors="replace").split())
            except OSError:
                continue
            return int(pid), command
    return None


def _listdir(path: str) -> list:
    try:
        return os.listdir(path)
    except OSError:
        return []


def wait_until_tf_ports_free(spec: ResourceSpec, timeout: float) -> bool:
    """Waits until no node of ``spec`` listens on the TensorFlow port any more.

    A job started right after another (a search's trials) would otherwise find a
    node's port still held by a process of the previous job that is still ending.

    Returns:
        bool: whether every port was free within ``timeout`` seconds.
    """
    if len(spec.nodes) < 2:
        return True  # a one-node job starts no TensorFlow server
    return not _poll_tf_ports(spec, listening=False, timeout=timeout)


def wait_until_tf_servers_listen(spec: ResourceSpec, timeout: float,
                                 check: Optional[Callable[[], None]] = None) -> None:
    """Returns once every node's TensorFlow server accepts connections.

    A session's gRPC channels reach every node at once. A channel refused by a
    server not yet started retries only after a back-off of up to a second, and a
    step's call over it fails at once meanwhile, so a node that started late and
    stepped at once would fail ("Connection refused"). No node opens its session
    before every server listens.

    Args:
        check: called between polls; raises to stop waiting (a worker that died).

    Raises:
        RuntimeError: naming the nodes whose servers did not listen within ``timeout``.
    """
    silent = _poll_tf_ports(spec, listening=True, timeout=timeout, check=check)
    if silent:
        raise RuntimeError(f"The TensorFlow servers of nodes {silent} did not accept "
                           f"connections on port {tf_port()} within {timeout:.0f} s.")


def _poll_tf_ports(spec: ResourceSpec, listening: bool, timeout: float,
                   check: Optional[Callable[[], None]] = None) -> list:
    """Polls every node's TensorFlow port until each listens (or none does).

    Returns:
        list: the nodes whose port was not yet so when ``timeout`` ran out.
    """
    port, deadline = tf_port(), time.monotonic() + timeout
    pending = list(spec.node_addresses)
    while True:
        pending = [a for a in pending if _accepts_connections(a, port) != listening]
        if not pending or time.monotonic() >= deadline:
            return pending
        if check is not None:
            check()
        time.sleep(0.2)


def _accepts_connections(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=2.0):
            return True
    except OSError:  # refused (nobody listens), unreachable or timed out
        return False


class ChiefCoordinator:
    """The chief's side: serves the strategy, launches workers, watches them.

    Args:
        spec: the cluster.
        strategy: the strategy every node applies.
        fingerprint: the chief's graph fingerprint.
        heartbeat_timeout: seconds of silence after which a worker counts as dead.
        worker_env: more environment for the workers' processes.
    """

    def __init__(self, spec: ResourceSpec, strategy, fingerprint: str,
                 heartbeat_timeout: float = 15.0, worker_env: Optional[dict] = None):
        self._spec = spec
        self._worker_env = dict(worker_env or {})
        self._workers = []
        self._failed = False
        self._steps_done = 0
        self._lock = threading.Lock()
        self._token = new_token()
        worker_nodes = [a for a in ordered_nodes(spec) if a != spec.chief]
        self._server = StrategyServer(strategy, fingerprint, self._token, worker_nodes,
                                      heartbeat_timeout=heartbeat_timeout)
        self._process_hooks = ProcessHooks()

    def start(self) -> None:
        """Serves the strategy and starts the script on every other node.

        Raises:
            RuntimeError: when this process already joined a multi-node job.
        """
        _join_job(NodeRole(self._spec.chief, True, 0))
        port = self._server.start()
        _at_exit(self.shutdown)
        self._process_hooks.install(self._stop_after_error, stop_on_sigterm=True)
        env = {CHIEF_ENV: self._spec.chief, SERVICE_PORT_ENV: str(port),
               TF_PORT_ENV: str(tf_port()), **self._worker_env}
        argv = [os.path.abspath(sys.argv[0]), *sys.argv[1:]]
        for address in ordered_nodes(self._spec)[1:]:
            node = self._spec.node(address)
            ssh = self._spec.ssh_configs.get(node.ssh_config) if node.ssh_config else None
            worker = launcher.launch(node, ssh, {**env, WORKER_ENV: address}, argv, os.getcwd(),
                                     secrets={TOKEN_ENV: self._token})
            with self._lock:
                self._workers.append(worker)

    def wait_ready(self, timeout: float) -> None:
        """Returns once every worker has joined; raises naming the first that failed."""
        deadline = time.monotonic() + timeout
        while True:
            self.check_workers()
            try:
                self._server.wait_ready(min(1.0, max(0.01, deadline - time.monotonic())))
                return
            except ServiceError as err:
                # A bare ServiceError is the barrier's timeout; the others name a failure.
                if type(err) is not ServiceError or time.monotonic() >= deadline:
                    self._failed = True
                    raise

    def step_done(self) -> None:
        """Counts a finished training step; a worker waiting for a step the chief will not
        run learns the count when the chief's script ends."""
        self._steps_done += 1

    def check_workers(self) -> None:
        """Raises naming a worker whose process ended badly or that stopped heartbeating."""
        with self._lock:
            workers = list(self._workers)
        try:
            # A worker's own report first: it says why, where its exit code tells how.
            self._server.check_workers()
            for worker in workers:
                if worker.exit_code() not in (None, 0):
                    raise WorkerFailedError(worker.node, worker.failure())
        except ServiceError:
            self._failed = True
            raise

    def shutdown(self) -> None:
        """Stops every worker and the service; safe to call more than once.

        After a normal end the workers get ``WORKER_EXIT_GRACE_S`` to finish their
        own last steps; a worker that fails meanwhile (one that waits for a step the
        chief's script did not run) ends the chief's process with exit code 1, naming
        it. After an error (or Ctrl-C) the workers are stopped at once.
        """
        deadline = time.monotonic() + WORKER_EXIT_GRACE_S
        failure = None if self._failed else self._workers_finished(deadline)
        with self._lock:
            workers, self._workers = self._workers, []
        # Workers stay up (their servers hold variables) until the service stops.
        self._server.stop()
        if not self._failed and failure is None:
            for worker in workers:
                try:
                    worker.process.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    break
        launcher.stop_all(workers)
        self._process_hooks.restore()
        if failure is not None:
            # At interpreter exit only os._exit can still make the exit code say so.
            sys.stderr.write(f"AutoDist: the chief's script ended, but {failure}\n")
            sys.stderr.flush()
            os._exit(1)

    def _workers_finished(self, deadline: float) -> Optional[ServiceError]:
        """Tells the workers the chief's script ended, after how many steps, and waits
        until each one's script ended too (or its process did), at most until
        ``deadline``.

        Returns:
            the first worker failure, or None.
        """
        chief = self._spec.chief
        self._server.end_script(chief, self._steps_done)
        while time.monotonic() < deadline:
            try:
                self.check_workers()
            except ServiceError as failure:
                return failure
            states = self._server.node_states()
            with self._lock:
                ended = {w.node for w in self._workers if w.exit_code() is not None}
            if all(states[node].done or node in ended for node in ordered_nodes(self._spec)[1:]):
                return None
            time.sleep(_POLL_S)
        return None

    def check_not_left(self, chief_steps_done: int) -> None:
        """Raises when a worker will not run the chief's step ``chief_steps_done + 1``,
        which then waits for it for ever.

        Raises:
            StoppedEarlyError: a callback stopped the worker's training before that step,
                where the chief's did not stop. The worker hears it first.
            NodeLeftError: the worker's script ended before that step.
        """
        chief = self._spec.chief
        states = self._server.node_states()
        stopped = _stopped_before(chief, states.get(chief, NodeState()).training_end,
                                  chief_steps_done, states)
        if stopped is not None:
            error = StoppedEarlyError.went_on(*stopped, chief)
            self._tell_workers(error, [node for node, state in states.items()
                                       if state.training_end == TrainingEnd(stopped[1], True)])
            raise error
        left = {node: steps for node, steps in self._server.finished_workers().items()
                if steps <= chief_steps_done}
        if left:
            node = sorted(left)[0]
            raise NodeLeftError(node, left[node], "the chief", chief_steps_done + 1)

    def training_ended(self, steps_done: int, early: bool) -> None:
        """The chief's training (a Keras ``fit``) ended after ``steps_done`` steps; the
        workers learn it at their next heartbeat.

        Args:
            early: a callback stopped it. Then this returns once every worker's training
                ended at the same step too (or its script did), so that no node waits
                for another in the next step.

        Raises:
            StoppedEarlyError: after an early stop, naming the first worker that failed
                (one that went on into the next step fails naming the chief).
        """
        chief = self._spec.chief
        self._server.end_training(chief, TrainingEnd(steps_done, early))
        while early:
            try:
                self.check_workers()
            except WorkerFailedError as failure:
                raise StoppedEarlyError.waited(chief, steps_done, failure.node,
                                               failure.reason) from None
            states = self._server.node_states()
            if all(_stopped_at(states[node], steps_done)
                   for node in ordered_nodes(self._spec)[1:]):
                return
            time.sleep(_POLL_S)

    def _tell_workers(self, error: Exception, stopped: list) -> None:
        """Tells the workers why the chief fails, and waits up to ``TELL_STOPPED_S`` for the
        ``stopped`` ones, which wait to hear whether the others stopped training too, to
        fail saying so: the chief's end stops them at once."""
        self._server.publish_failure(self._spec.chief, f"{type(error).__name__}: {error}")
        deadline = time.monotonic() + TELL_STOPPED_S
        while time.monotonic() < deadline:
            states = self._server.node_states()
            with self._lock:
                ended = {w.node for w in self._workers if w.exit_code() is not None}
            if all(states[node].failure or node in ended for node in stopped):
                return
            time.sleep(_POLL_S)

    def stuck_nodes(self, chief_steps_done: int) -> list:
        """The nodes still in the step after the chief's ``chief_steps_done`` (chief first)."""
        done = self._server.steps_done()
        return [self._spec.chief] + [node for node in ordered_nodes(self._spec)[1:]
                                     if done.get(node, 0) <= chief_steps_done]

    def _stop_after_error(self, error: BaseException) -> None:
        """An error ends the chief: stop the workers at once, without waiting for them."""
        self._failed = True
        self.shutdown()


class NodeLeftError(RuntimeError):
    """A node's script ended while another still trains: the nodes ran unequal steps.

    Attributes:
        node: the address of the node whose script ended.
        steps: the training steps it ran.
    """

    def __init__(self, node: str, steps: int, waiting: str, step: int):
        """``waiting`` (e.g. "the chief") waits for ``node`` in its step ``step``."""
        self.node, self.steps = node, steps
        super().__init__(
            f"AutoDist: node {node!r} finished its script after {steps} training steps, "
            f"while {waiting} waits for it in step {step}: it ran out of data, or "
            "stopped training early (a callback setting stop_training). Every node must run "
            "the same number of steps: give every node as many batches "
            "(e.g. the same steps_per_epoch, or dataset.repeat() and take()).")


class StoppedEarlyError(RuntimeError):
    """A callback stopped training (``model.stop_training``) on some nodes only: the others
    went on into a step that needs every node.

    Attributes:
        node: the node whose training stopped early.
        steps: the training steps it ran.
    """

    def __init__(self, node: str, steps: int, detail: str):
        self.node, self.steps = node, steps
        super().__init__(f"AutoDist: node {node!r} stopped training early after {steps} "
                         f"training steps (a callback set model.stop_training there){detail}")

    @classmethod
    def went_on(cls, node: str, steps: int, other: str) -> "StoppedEarlyError":
        """The error of ``other``, which went on into the next step."""
        return cls(node, steps,
                   f", while node {other!r} went on into step {steps + 1}, which needs every "
                   "node: each would wait for the other for ever. Every node must run the same "
                   "training steps: make the callback decide the same on every node, at the "
                   "same batch (from the epoch or batch number, or from values every node "
                   "holds alike; a node's logs cover its own rows only), or train a fixed "
                   "number of epochs.")

    @classmethod
    def waited(cls, node: str, steps: int, failed: str, reason: str) -> "StoppedEarlyError":
        """The error of ``node``, which stopped and waited for the others, one of which failed."""
        return cls(node, steps, f"; it waited for the other nodes to stop there too, but "
                                f"node {failed!r} failed: {reason}")


def _stopped_before(node: str, own_end: Optional[TrainingEnd], steps_done: int,
                    states: Dict[str, NodeState]) -> Optional[Tuple[str, int]]:
    """Another node that a callback stopped after ``steps_done`` steps or fewer, at a step
    where ``node``'s own training did not end: it will not run ``node``'s step
    ``steps_done + 1``. Nodes that stopped at the same step (and may train on together
    in a later ``fit``) agree.

    Returns:
        (that node, its steps), or None.
    """
    for other, state in sorted(states.items()):
        end = state.training_end
        if (other != node and end is not None and end.early and end.steps <= steps_done
                and (own_end is None or own_end.steps != end.steps)):
            return other, end.steps
    return None


def _stopped_at(state: NodeState, steps: int) -> bool:
    """Whether a node's training ended after ``steps`` steps too, or its script ended."""
    return state.done or (state.training_end is not None and state.training_end.steps == steps)


class WorkerAgent:
    """A worker's side: fetches the strategy from the chief and reports to it."""

    def __init__(self, role: NodeRole):
        _join_job(role)  # before it reads a token no chief sent: a second job is named
        _die_with_launcher()
        token = launcher.read_secrets().get(TOKEN_ENV) or os.environ.get(TOKEN_ENV, "")
        self._client = StrategyClient(*role.service, token, role.address)
        self._role = role
        self._client.start_heartbeat(on_chief_lost=_exit_orphaned, lost_after=CHIEF_LOST_S)
        _at_exit(self.close)
        self._process_hooks = ProcessHooks()
        self._process_hooks.install(self._report_error, stop_on_sigterm=False)

    def fetch_strategy(self, fingerprint: str):
        return self._client.fetch_strategy(fingerprint)

    def report_ready(self) -> None:
        self._client.report_ready()

    def step_done(self) -> None:
        """Counts a finished training step; the heartbeats tell the chief."""
        self._client.steps_done += 1

    def report_failed(self, message: str) -> None:
        self._client.report_failed(message)

    def check_not_left(self, steps_done: int) -> None:
        """Raises when another node will not run this worker's step ``steps_done + 1`` (as
        the latest heartbeat tells), which then waits for it for ever.

        Raises:
            StoppedEarlyError: a callback stopped the node's training before that step,
                at a step where this worker's did not stop.
            NodeLeftError: the chief's script ended before that step.
        """
        me, chief = self._role.address, self._role.service[0]
        stopped = _stopped_before(me, self._client.training_end, steps_done,
                                  self._client.node_states)
        if stopped is not None:
            raise StoppedEarlyError.went_on(*stopped, me)
        chief_state = self._client.node_states.get(chief)
        if chief_state is not None and chief_state.done and chief_state.steps_done <= steps_done:
            raise NodeLeftError(chief, chief_state.steps_done, f"node {me!r}", steps_done + 1)

    def training_ended(self, steps_done: int, early: bool) -> None:
        """This worker's training (a Keras ``fit``) ended after ``steps_done`` steps; the
        chief learns it at once, the other workers at their next heartbeat.

        Args:
            early: a callback stopped it. Then this returns once every other node's
                training ended at the same step too (or its script did, or the chief's
                job is over), so that no node waits for another in the next step.

        Raises:
            StoppedEarlyError: after an early stop, naming the first node that failed
                (one that went on into the next step fails naming this worker).
        """
        me, chief = self._role.address, self._role.service[0]
        self._client.training_end = TrainingEnd(steps_done, early)
        while True:
            try:
                states = self._client.heartbeat()
            except ServiceError:
                return  # the chief's service has stopped: its job is over
            if not early:
                return
            others = {node: states.get(node, NodeState())
                      for node in sorted({chief, *states} - {me})}
            failed = next(((node, state.failure) for node, state in others.items()
                           if state.failure), None)
            if failed is not None:
                raise StoppedEarlyError.waited(me, steps_done, *failed)
            if all(_stopped_at(state, steps_done) for state in others.values()):
                return
            time.sleep(_POLL_S)

    def _report_error(self, error: BaseException) -> None:
        """An error ends this worker: the chief learns why, if it still listens."""
        try:
            self._client.report_failed(f"{type(error).__name__}: {error}"[:2000])
        except ServiceError:
            pass
        self._client.close()

    def close(self) -> None:
        """Reports done, then stays until the chief's job is over: variables placed on
        this node's server must outlive the chief's last reads of them."""
        try:
            self._client.report_done()
            self._client.wait_until_chief_gone()
        except ServiceError:
            pass
        self._client.close()
        self._process_hooks.restore()


def _die_with_launcher() -> None:
    """Has the kernel kill this worker when the process that launched it ends.

    A chief killed outright (SIGKILL, a timeout) cannot stop its workers; without
    this they would train on until the heartbeat notices, holding their ports.
    Linux only; elsewhere the heartbeat alone ends orphans.
    """
    end_with_parent(signal.SIGKILL)


def end_with_parent(signum: int) -> None:
    """Has the kernel send this process ``signum`` when its parent ends (Linux only).

    The process exits at once if its parent ended already.
    """
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None).prctl(pr_set_pdeathsig, signum)
    if os.getppid() == 1:  # the parent ended before the call above
        os._exit(1)


class ProcessHooks:
    """The process-wide handlers a node of a cluster job installs, and their restoring.

    * ``sys.excepthook``: the process ends right after an uncaught error is
      printed and ``cleanup`` ran. Python would next free the error's frames,
      and with them the session; closing a TensorFlow session whose step waits
      on a failed peer blocks for ever, holding the GIL, so not even the
      heartbeat's orphan check could end the process.
    * SIGTERM (the chief's): raises :class:`Terminated`, so that it ends the
      chief as an error does, stopping the workers at once, and the process
      exits with status 128 + SIGTERM after saying so.

    The node restores the previous handlers once its job is over.
    """

    def __init__(self):
        self._previous_excepthook = None
        self._previous_sigterm = None

    def install(self, cleanup: Callable[[BaseException], None], stop_on_sigterm: bool) -> None:
        previous = self._previous_excepthook = sys.excepthook

        def hook(kind, error, traceback):
            if isinstance(error, Terminated):
                sys.stderr.write(f"{error}\n")
            else:
                previous(kind, error, traceback)
            try:
                cleanup(error)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                if isinstance(error, Terminated):
                    os._exit(128 + error.signum)
                os._exit(130 if isinstance(error, KeyboardInterrupt) else 1)

        sys.excepthook = hook
        # Signal handlers can only be set from the main thread.
        if stop_on_sigterm and threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_terminated)

    def restore(self) -> None:
        """Puts back the handlers found at :meth:`install`; safe to call more than once."""
        if self._previous_excepthook is not None:
            sys.excepthook, self._previous_excepthook = self._previous_excepthook, None
        if (self._previous_sigterm is not None
                and threading.current_thread() is threading.main_thread()):
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None


def _raise_terminated(signum, frame) -> None:
    raise Terminated(signum)


class Terminated(BaseException):
    """The chief was told to stop (SIGTERM: ``kill``, Slurm, Kubernetes)."""

    def __init__(self, signum: int):
        super().__init__(f"AutoDist: the chief received {signal.Signals(signum).name}; "
                         "stopped the job and its workers.")
        self.signum = signum


def _exit_orphaned() -> None:
    """Ends a worker whose chief has gone: nothing will ever stop it otherwise."""
    sys.stderr.write(f"AutoDist worker: the chief has not answered for {CHIEF_LOST_S:.0f} s; "
                     "exiting.\n")
    os._exit(1)


def _at_exit(callback) -> None:
    """Runs ``callback`` at interpreter exit, while gRPC's thread pools still work.

    ``atexit`` runs after ``concurrent.futures`` has refused new work, which breaks
    the last calls between chief and workers; Python's threading exit hooks run
    before it (newest first).
    """
    register = getattr(threading, "_register_atexit", atexit.register)
    register(callback)

