"""Strategy service: the chief serves its strategy; workers fetch it, report status and heartbeat.

The chief runs a :class:`StrategyServer` at its address from the resource
spec. Each worker runs a :class:`StrategyClient` that fetches the strategy
(sending its graph fingerprint, which must equal the chief's), reports READY
or FAILED, and sends heartbeats while it trains. The chief waits on a barrier
(:meth:`StrategyServer.wait_ready`) and checks for dead or hung workers
between steps (:meth:`StrategyServer.check_workers`). A heartbeat carries where
the worker's training ended (:class:`TrainingEnd`), and its answer what the chief
knows of every node (:class:`NodeState`), so that every node learns within
seconds that another stopped training early.

Every call carries a per-job secret token (:func:`new_token`, made by the chief
and handed to launched workers on their standard input as ``AUTODIST_JOB_TOKEN``,
see ``launcher.launch``) in gRPC metadata; calls without it, or with a wrong
one, are refused with ``UNAUTHENTICATED``.
"""
from __future__ import annotations

import copy
import dataclasses
import hmac
import logging
import secrets
import threading
import time
from concurrent import futures
from typing import Callable, Dict, List, Optional, Sequence

import grpc

from autodist.proto import service_pb2, service_pb2_grpc
from autodist.strategy.base import Strategy

TOKEN_ENV = "AUTODIST_JOB_TOKEN"
# gRPC metadata keys must be lowercase; "-bin" keys carry raw bytes.
TOKEN_METADATA_KEY = "autodist-job-token"
_CHIEF_FINGERPRINT_KEY = "autodist-chief-fingerprint-bin"
_REFUSED = "refused: bad or missing job token"
_Status = service_pb2.StatusReport.Status

logger = logging.getLogger(__name__)


class ServiceError(RuntimeError):
    """The strategy service failed: unreachable chief, refused call, timeout or a failed worker."""


class FingerprintMismatchError(ServiceError):
    """A worker's graph fingerprint differs from the chief's.

    Attributes:
        node: the worker's address.
        worker_fingerprint: the worker's graph fingerprint.
        chief_fingerprint: the chief's graph fingerprint.
    """

    def __init__(self, node: str, worker_fingerprint: str, chief_fingerprint: str):
        self.node = node
        self.worker_fingerprint = worker_fingerprint
        self.chief_fingerprint = chief_fingerprint
        worker, chief = worker_fingerprint.split("|"), chief_fingerprint.split("|")
        if worker[0] != chief[0] or len(worker) != len(chief):
            message = (f"Worker node {node!r} has graph fingerprint {worker[0]!r} but the "
                       f"chief has {chief[0]!r}: the worker's graph differs from the chief's. "
                       "Run the same model code, inputs and AutoDist version on every node.")
        else:
            differ = [w.split("=")[0] for w, c in zip(worker[1:], chief[1:]) if w != c]
            message = (f"Worker node {node!r} builds the chief's graph but trains with other "
                       f"settings: {', '.join(differ)} differ (the optimizer's hyperparameters "
                       "by name; constants: a loss weight, a rate or another scalar of the "
                       "step). Compile the model and the optimizer with the same arguments on "
                       "every node.")
        super().__init__(message)

    def __reduce__(self):
        return type(self), (self.node, self.worker_fingerprint, self.chief_fingerprint)


class WorkerFailedError(ServiceError):
    """A worker reported a failure, or stopped sending heartbeats.

    Attributes:
        node: the worker's address.
        reason: the worker's own message, or a description of the lost heartbeat.
    """

    def __init__(self, node: str, reason: str):
        self.node = node
        self.reason = reason
        super().__init__(f"Worker node {node!r} failed: {reason}")

    def __reduce__(self):
        return type(self), (self.node, self.reason)


def new_token() -> str:
    """Makes a fresh per-job secret token.

    Returns:
        str: 32 random hex digits.
    """
    return secrets.token_hex(16)


@dataclasses.dataclass(frozen=True)
class TrainingEnd:
    """Where a node's training (a Keras ``fit``) ended.

    Attributes:
        steps: the training steps the node had finished.
        early: a callback stopped it (``model.stop_training``).
    """

    steps: int
    early: bool


@dataclasses.dataclass(frozen=True)
class NodeState:
    """What the chief knows of a node, as every node sees it through the heartbeats.

    Attributes:
        training_end: where its latest training ended; None before one did.
        done: its script ended, after ``steps_done`` training steps.
        steps_done: its training steps, as of its latest heartbeat.
        failure: why it failed; None unless it did.
    """

    training_end: Optional[TrainingEnd] = None
    done: bool = False
    steps_done: int = 0
    failure: Optional[str] = None


def _training_end_proto(end: Optional[TrainingEnd]) -> Optional[service_pb2.TrainingEnd]:
    return None if end is None else service_pb2.TrainingEnd(steps=end.steps, early=end.early)


def _join_host_port(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):  # bare IPv6 literal
        host = f"[{host}]"
    return f"{host}:{port}"


@dataclasses.dataclass
class _NodeState:
    status: int = _Status.STATUS_UNSPECIFIED
    last_seen: Optional[float] = None  # monotonic time of the latest call
    failure: Optional[ServiceError] = None  # first failure; never cleared
    steps_done: int = 0  # training steps finished, as of the latest heartbeat
    training_end: Optional[TrainingEnd] = None  # where its latest training ended

    def public(self) -> NodeState:
        return NodeState(self.training_end, self.status == _Status.DONE, self.steps_done,
                         None if self.failure is None else str(self.failure))


class _Registry:
    """What the chief knows about each expected worker; all access under one condition."""

    def __init__(self, nodes: Sequence[str], chief_fingerprint: str, heartbeat_timeout: float):
        self.changed = threading.Condition()
        self.nodes = {node: _NodeState() for node in nodes}
        # The serving node's own state (the chief's), told to the workers alone: its
        # failure is not one of theirs.
        self.own: Dict[str, _NodeState] = {}
        self._chief_fingerprint = chief_fingerprint
        self._heartbeat_timeout = heartbeat_timeout

    def touch(self, node: str) -> None:
        with self.changed:
            self.nodes[node].last_seen = time.monotonic()

    def set_status(self, node: str, status: int) -> None:
        with self.changed:
            if self.nodes[node].failure is None:  # a failed worker stays failed
                self.nodes[node].status = status
                self.changed.notify_all()

    def fail(self, node: str, error: ServiceError) -> None:
        with self.changed:
            state = self.nodes[node]
            if state.failure is None:  # the first cause is the useful one
                state.failure = error
                logger.error("%s", error)
            state.status = _Status.FAILED
            self.changed.notify_all()

    def public_states_locked(self) -> Dict[str, NodeState]:
        """Every worker's state and the chief's own, as the nodes see them (call under the lock)."""
        return {node: state.public() for node, state in [*self.nodes.items(), *self.own.items()]}

    def first_failure_locked(self) -> Optional[ServiceError]:
        """Marks silent workers as failed, then returns the first failure (call under the lock)."""
        now = time.monotonic()
        for node, state in self.nodes.items():
            silent = None if state.last_seen is None else now - state.last_seen
            if (state.failure is None and state.status != _Status.DONE
                    and silent is not None and silent > self._heartbeat_timeout):
                state.failure = WorkerFailedError(
                    node, f"no heartbeat for {silent:.1f} s (heartbeat_timeout="
                          f"{self._heartbeat_timeout:g} s); its process died or hangs.")
                state.status = _Status.FAILED
                logger.error("%s", state.failure)
        for state in self.nodes.values():
            if state.failure is not None:
                return state.failure
        return None


class _Servicer(service_pb2_grpc.StrategyServiceServicer):
    """The RPC handlers; the token was already checked by :class:`_TokenInterceptor`."""

    def __init__(self, strategy: Strategy, fingerprint: str, registry: _Registry):
        self._response = service_pb2.GetStrategyResponse(strategy=strategy.proto)
        self._fingerprint = fingerprint
        self._registry = registry

    def _known_node(self, node: str, context: grpc.ServicerContext) -> str:
        if node not in self._registry.nodes:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"Node {node!r} is not one of the workers this chief expects "
                          f"({sorted(self._registry.nodes)}); start the worker with its address "
                          "from the resource spec.")
        self._registry.touch(node)
        return node

    def GetStrategy(self, request, context):  # noqa: N802 (gRPC naming)
        node = self._known_node(request.node, context)
        if request.fingerprint != self._fingerprint:
            error = FingerprintMismatchError(node, request.fingerprint, self._fingerprint)
            self._registry.fail(node, error)
            context.set_trailing_metadata(((_CHIEF_FINGERPRINT_KEY, self._fingerprint.encode()),))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        return self._response

    def ReportStatus(self, request, context):  # noqa: N802
        node = self._known_node(request.node, context)
        if request.status == _Status.FAILED:
            self._registry.fail(node, WorkerFailedError(node, request.message or "(no message)"))
        elif request.status in (_Status.READY, _Status.DONE):
            self._registry.set_status(node, request.status)
        else:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"ReportStatus from node {node!r} has status={request.status}; "
                          "expected READY, FAILED or DONE.")
        return service_pb2.Ack()

    def Heartbeat(self, request, context):  # noqa: N802
        node = self._known_node(request.node, context)
        with self._registry.changed:
            state = self._registry.nodes[node]
            state.steps_done = request.steps_done
            if request.HasField("training_end"):
                state.training_end = TrainingEnd(request.training_end.steps,
                                                 request.training_end.early)
            states = self._registry.public_states_locked()
        return service_pb2.HeartbeatResponse(nodes=[
            service_pb2.NodeState(node=name, training_end=_training_end_proto(state.training_end),
                                  done=state.done, steps_done=state.steps_done,
                                  failure=state.failure or "")
            for name, state in states.items()])


class _TokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call whose metadata lacks the job token."""

    def __init__(self, token: str):
        self._token = token.encode()
        self._refuse = grpc.unary_unary_rpc_method_handler(self._abort)

    @staticmethod
    def _abort(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSED)

    def intercept_service(self, continuation, handler_call_details):
        sent = dict(handler_call_details.invocation_metadata or ()).get(TOKEN_METADATA_KEY, "")
        if hmac.compare_digest(str(sent).encode(), self._token):
            return continuation(handler_call_details)
        return self._refuse


class StrategyServer:
    """Serves the chief's strategy to the workers and tracks their status.

    Args:
        strategy: the strategy to serve (copied: later changes are not served).
        fingerprint: the chief's graph fingerprint; workers must send the same.
        token: the per-job secret (see :func:`new_token`).
        nodes: addresses of the workers expected (not the chief).
        host: interface to listen on.
        port: port to listen on; 0 picks a free one.
        heartbeat_timeout: seconds of silence, after a worker first called,
            before it counts as dead or hung.

    Raises:
        ValueError: if the token is empty, ``nodes`` repeats an address or
            ``heartbeat_timeout`` is not positive.

    Note:
        Workers must keep calling (``StrategyClient.start_heartbeat``) from
        their first call on: the heartbeat check also runs during the barrier.
    """

    def __init__(self, strategy: Strategy, fingerprint: str, token: str, nodes: List[str],
                 host: str = "0.0.0.0", port: int = 0, heartbeat_timeout: float = 15.0):
        if not token:
            raise ValueError("StrategyServer needs a non-empty token; make one with new_token().")
        if len(set(nodes)) != len(nodes):
            raise ValueError(f"StrategyServer nodes={list(nodes)} lists a worker more than once.")
        if heartbeat_timeout <= 0:
            raise ValueError(f"StrategyServer heartbeat_timeout={heartbeat_timeout!r} must be > 0.")
        self._strategy = strategy.copy()
        self._fingerprint = fingerprint
        self._token = token
        self._nodes = list(nodes)
        self._host = host
        self._port = port
        self._registry = _Registry(self._nodes, fingerprint, heartbeat_timeout)
        self._server: Optional[grpc.Server] = None

    @property
    def port(self) -> int:
        """int: the bound port once started; the requested one before."""
        return self._port

    @property
    def address(self) -> str:
        """str: ``host:port`` the server listens on (the bound port once started)."""
        return _join_host_port(self._host, self._port)

    def start(self) -> int:
        """Starts listening.

        Returns:
            int: the bound port.

        Raises:
            ServiceError: if already started, or the address cannot be bound
                (e.g. the port is in use).
        """
        if self._server is not None:
            raise ServiceError(f"StrategyServer at {self.address} is already started.")
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=min(32, len(self._nodes) + 4),
                                       thread_name_prefix="autodist-strategy-service"),
            interceptors=[_TokenInterceptor(self._token)],
            # Without this a second server could share the port silently.
            options=[("grpc.so_reuseport", 0)])
        service_pb2_grpc.add_StrategyServiceServicer_to_server(
            _Servicer(self._strategy, self._fingerprint, self._registry), server)
        target = self.address
        try:
            bound = server.add_insecure_port(target)
        except RuntimeError as err:  # newer grpcio raises instead of returning 0
            logger.debug("Binding %s failed: %s", target, err)
            bound = 0
        if not bound:
            server.stop(None)
            raise ServiceError(
                f"StrategyServer cannot listen on {target}: the port is in use or the host is "
                "not an address of this machine. Pick another port or stop the other process.")
        server.start()
        self._server, self._port = server, bound
        logger.info("StrategyServer listening on %s for workers %s.", self.address, self._nodes)
        return bound

    def wait_ready(self, timeout: float) -> None:
        """Barrier: waits until every expected worker has reported READY.

        Args:
            timeout: seconds to wait at most.

        Raises:
            FingerprintMismatchError: as soon as a worker's fingerprint differs.
            WorkerFailedError: as soon as a worker reports FAILED or stops
                sending heartbeats.
            ServiceError: on timeout, naming the workers still missing.
        """
        deadline = time.monotonic() + timeout
        with self._registry.changed:
            while True:
                failure = self._registry.first_failure_locked()
                if failure is not None:
                    raise copy.copy(failure)  # a fresh error each time, not a shared traceback
                states = self._registry.nodes
                missing = [n for n, s in states.items()
                           if s.status not in (_Status.READY, _Status.DONE)]
                if not missing:
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    silent = [n for n in missing if states[n].last_seen is None]
                    raise ServiceError(
                        f"Timed out after {timeout:g} s waiting for workers to report ready; "
                        f"still missing: {missing} (never contacted the chief: {silent}). Check "
                        f"that they were launched, can reach {self.address} and use the job "
                        "token the chief hands them.")
                # Wake up now and then to notice lost heartbeats.
                self._registry.changed.wait(min(remaining, 0.25))

    def steps_done(self) -> dict:
        """Worker -> the training steps it had finished at its latest heartbeat."""
        with self._registry.changed:
            return {node: state.steps_done for node, state in self._registry.nodes.items()}

    def node_states(self) -> Dict[str, NodeState]:
        """Node -> what the chief knows of it: every worker, and the chief once it has
        told its own (:meth:`end_training`, :meth:`publish_failure`)."""
        with self._registry.changed:
            return self._registry.public_states_locked()

    def end_training(self, node: str, end: TrainingEnd) -> None:
        """Records where the serving node's (the chief's) training ended, for the workers."""
        with self._registry.changed:
            self._registry.own.setdefault(node, _NodeState()).training_end = end

    def publish_failure(self, node: str, message: str) -> None:
        """Tells the workers, at their next heartbeat, why the serving node (the chief) fails."""
        with self._registry.changed:
            state = self._registry.own.setdefault(node, _NodeState())
            state.failure = ServiceError(message)
            state.status = _Status.FAILED

    def end_script(self, node: str, steps: int) -> None:
        """Tells the workers, at their next heartbeat, that the serving node's (the
        chief's) script ended after ``steps`` training steps."""
        with self._registry.changed:
            state = self._registry.own.setdefault(node, _NodeState())
            state.steps_done = steps
            if state.failure is None:
                state.status = _Status.DONE

    def finished_workers(self) -> dict:
        """Worker -> its training steps, for the workers whose script has ended normally."""
        with self._registry.changed:
            return {node: state.steps_done for node, state in self._registry.nodes.items()
                    if state.status == _Status.DONE}

    def check_workers(self) -> None:
        """Raises if a worker failed or went silent; cheap, meant to run between steps.

        Raises:
            WorkerFailedError: if a worker reported FAILED, or has sent no call
                for ``heartbeat_timeout`` seconds after its first one.
            FingerprintMismatchError: if a worker's fingerprint differed.
        """
        with self._registry.changed:
            failure = self._registry.first_failure_locked()
        if failure is not None:
            raise copy.copy(failure)

    def failures(self) -> Dict[str, str]:
        """Returns the failures seen so far.

        Returns:
            dict[str, str]: worker address -> error message.
        """
        with self._registry.changed:
            self._registry.first_failure_locked()
            return {n: str(s.failure) for n, s in self._registry.nodes.items()
                    if s.failure is not None}

    def stop(self) -> None:
        """Stops serving; in-flight calls get one second to finish. Idempotent."""
        if self._server is not None:
            self._server.stop(grace=1.0).wait()
            self._server = None

    def __enter__(self) -> "StrategyServer":
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


class StrategyClient:
    """A worker's connection to the chief's :class:`StrategyServer`.

    Args:
        chief_address: the chief's host.
        port: the StrategyServer's port.
        token: the per-job secret, normally ``os.environ[TOKEN_ENV]``.
        node: this worker's address as listed in the resource spec.
        timeout: seconds each call may wait for the chief (it may not be up yet).

    Note:
        Call :meth:`start_heartbeat` before :meth:`fetch_strategy`: the chief
        declares a worker dead ``heartbeat_timeout`` seconds after its last
        call, from its first call on.
    """

    def __init__(self, chief_address: str, port: int, token: str, node: str,
                 timeout: float = 30.0):
        self._target = _join_host_port(chief_address, port)
        self._node = node
        self._timeout = timeout
        self._metadata = ((TOKEN_METADATA_KEY, token),)
        self._channel = grpc.insecure_channel(self._target)
        self._stub = service_pb2_grpc.StrategyServiceStub(self._channel)
        self._stop_heartbeat = threading.Event()
        self._heartbeat: Optional[threading.Thread] = None
        self.steps_done = 0  # training steps this worker finished; heartbeats report it
        self.training_end: Optional[TrainingEnd] = None  # heartbeats report it too
        # What the chief knew of every node at the latest heartbeat; replaced, never changed.
        self.node_states: Dict[str, NodeState] = {}

    def _error(self, err: grpc.RpcError, method: str, timeout: float) -> ServiceError:
        code, details = err.code(), err.details()
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return ServiceError(
                f"StrategyService at {self._target} {_REFUSED} (call {method} from node "
                f"{self._node!r}); workers must use the job token the chief hands them.")
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return ServiceError(
                f"Cannot reach the chief's StrategyService at {self._target} within {timeout:g} s "
                f"({code.name}: {details}); check that the chief is running and that the address "
                "and port are right.")
        return ServiceError(f"StrategyService at {self._target} rejected {method} from node "
                            f"{self._node!r}: {code.name}: {details}")

    def _call(self, method: str, request, timeout: Optional[float] = None,
              wait_for_ready: bool = True):
        timeout = self._timeout if timeout is None else timeout
        try:
            return getattr(self._stub, method)(request, timeout=timeout, metadata=self._metadata,
                                               wait_for_ready=wait_for_ready)
        except grpc.RpcError as err:
            if method == "GetStrategy" and err.code() == grpc.StatusCode.FAILED_PRECONDITION:
                chief = dict(err.trailing_metadata() or ()).get(_CHIEF_FINGERPRINT_KEY, b"?")
                raise FingerprintMismatchError(
                    self._node, request.fingerprint, chief.decode(errors="replace")) from None
            raise self._error(err, method, timeout) from err

    def fetch_strategy(self, fingerprint: str) -> Strategy:
        """Fetches the chief's strategy.

        Args:
            fingerprint: this worker's graph fingerprint.

        Returns:
            Strategy: the chief's strategy.

        Raises:
            FingerprintMismatchError: if ``fingerprint`` differs from the
                chief's; the chief has recorded the failure already.
            ServiceError: if the chief is unreachable within the timeout or
                refuses the call.
        """
        request = service_pb2.GetStrategyRequest(node=self._node, fingerprint=fingerprint)
        return Strategy(self._call("GetStrategy", request).strategy)

    def _report(self, status: int, message: str = "", wait_for_ready: bool = True) -> None:
        self._call("ReportStatus",
                   service_pb2.StatusReport(node=self._node, status=status, message=message),
                   wait_for_ready=wait_for_ready)

    def report_ready(self) -> None:
        """Tells the chief this worker is ready to train.

        Raises:
            ServiceError: if the chief is unreachable or refuses the call.
        """
        self._report(_Status.READY)

    def report_failed(self, message: str) -> None:
        """Tells the chief this worker failed.

        Args:
            message: why; the chief's error quotes it.

        Raises:
            ServiceError: if the chief is unreachable or refuses the call.
        """
        self._report(_Status.FAILED, message)

    def report_done(self) -> None:
        """Tells the chief this worker finished normally, so its silence is not a failure.

        Does not wait for an unreachable chief: at the end of a job it has often
        ended already. Stops the heartbeat first: the chief going silent from now
        on is the normal end, not a failure to warn about.

        Raises:
            ServiceError: if the chief is unreachable or refuses the call.
        """
        self._end_heartbeat()
        # The steps it finished, so that the chief can tell whether it left early.
        self.heartbeat(timeout=2.0)
        self._report(_Status.DONE, wait_for_ready=False)

    def heartbeat(self, timeout: float = 2.0) -> Dict[str, NodeState]:
        """Sends a heartbeat now, with this worker's steps and training end.

        Returns:
            dict[str, NodeState]: what the chief knows of every node (also kept
            as ``node_states``).

        Raises:
            ServiceError: if the chief is unreachable or refuses the call.
        """
        request = service_pb2.HeartbeatRequest(node=self._node, steps_done=self.steps_done,
                                               training_end=_training_end_proto(self.training_end))
        response = self._call("Heartbeat", request, timeout=timeout, wait_for_ready=False)
        self.node_states = {
            state.node: NodeState(
                TrainingEnd(state.training_end.steps, state.training_end.early)
                if state.HasField("training_end") else None,
                state.done, state.steps_done, state.failure or None)
            for state in response.nodes}
        return self.node_states

    def start_heartbeat(self, interval: float = 2.0,
                        on_chief_lost: Optional[Callable[[], None]] = None,
                        lost_after: float = 30.0) -> None:
        """Starts a daemon thread that sends a heartbeat every ``interval`` seconds.

        Does nothing if the heartbeat already runs.

        Args:
            interval: seconds between heartbeats; well below the chief's
                ``heartbeat_timeout``.
            on_chief_lost: called (from the heartbeat thread) once heartbeats have
                failed for ``lost_after`` seconds in a row: the chief is gone.
            lost_after: see ``on_chief_lost``.

        Raises:
            ValueError: if ``interval`` is not positive.
        """
        if interval <= 0:
            raise ValueError(f"start_heartbeat interval={interval!r} must be > 0.")
        if self._heartbeat is not None and self._heartbeat.is_alive():
            return
        self._stop_heartbeat.clear()
        self._heartbeat = threading.Thread(target=self._beat,
                                           args=(interval, on_chief_lost, lost_after),
                                           daemon=True, name=f"autodist-heartbeat-{self._node}")
        self._heartbeat.start()

    def _beat(self, interval: float, on_chief_lost, lost_after: float) -> None:
        failing_since = None
        while not self._stop_heartbeat.is_set():
            try:
                self.heartbeat(timeout=max(interval, 1.0))
                failing_since = None
            except ServiceError as err:
                if failing_since is None and not self._stop_heartbeat.is_set():
                    logger.warning("Heartbeat from node %r failed: %s", self._node, err)
                failing_since = failing_since or time.monotonic()
                if on_chief_lost and time.monotonic() - failing_since >= lost_after:
                    on_chief_lost()
                    return
            self._stop_heartbeat.wait(interval)

    def wait_until_chief_gone(self, poll: float = 0.5) -> None:
        """Returns once the chief's service stops answering (its job is over)."""
        request = service_pb2.HeartbeatRequest(node=self._node, steps_done=self.steps_done)
        while True:
            try:
                self._call("Heartbeat", request, timeout=max(poll, 1.0), wait_for_ready=False)
            except ServiceError:
                return
            time.sleep(poll)

    def close(self) -> None:
        """Stops the heartbeat and closes the channel. Idempotent."""
        self._end_heartbeat()
        self._channel.close()

    def _end_heartbeat(self) -> None:
        self._stop_heartbeat.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5.0)
            self._heartbeat = None

    def __enter__(self) -> "StrategyClient":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
