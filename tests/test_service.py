"""Strategy service over real gRPC on 127.0.0.1: fetch, token, fingerprints, barrier, heartbeats."""
import socket
import threading
import time

import grpc
import pytest

from autodist.cluster.service import (TOKEN_METADATA_KEY, FingerprintMismatchError, ServiceError,
                                      StrategyClient, StrategyServer, WorkerFailedError, new_token)
from autodist.proto import service_pb2, service_pb2_grpc, strategy_pb2
from autodist.strategy.base import Strategy

pytestmark = pytest.mark.timeout(60)

HOST = "127.0.0.1"
FINGERPRINT = "fp-chief-0123"


def _strategy() -> Strategy:
    proto = strategy_pb2.Strategy()
    proto.graph_config.replicas.extend(["10.0.0.1:CPU:0", "10.0.0.2:CPU:0"])
    node = proto.node_config.add(var_name="dense/kernel")
    node.AllReduceSynchronizer.SetInParent()
    return Strategy(proto)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


@pytest.fixture
def token():
    return new_token()


@pytest.fixture
def make_server(token):
    servers = []

    def make(nodes=("w1", "w2"), heartbeat_timeout=15.0, strategy=None):
        server = StrategyServer(strategy or _strategy(), FINGERPRINT, token, list(nodes),
                                host=HOST, heartbeat_timeout=heartbeat_timeout)
        server.start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


@pytest.fixture
def make_client(token):
    clients = []

    def make(port, node, job_token=None, timeout=10.0):
        client = StrategyClient(HOST, port, token if job_token is None else job_token, node,
                                timeout=timeout)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def test_new_token_is_random_hex():
    first, second = new_token(), new_token()
    assert len(first) == 32 and int(first, 16) >= 0
    assert first != second


def test_fetch_round_trip_equals_served_strategy(make_server, make_client):
    strategy = _strategy()
    server = make_server(strategy=strategy)
    fetched = make_client(server.port, "w1").fetch_strategy(FINGERPRINT)
    assert fetched == strategy
    assert fetched.id == strategy.id


@pytest.mark.parametrize("metadata", [None, ((TOKEN_METADATA_KEY, "not-the-token"),)],
                         ids=["no_token", "wrong_token"])
def test_raw_call_without_the_token_is_refused(make_server, metadata):
    server = make_server()
    port = server.port
    with grpc.insecure_channel(f"{HOST}:{port}") as channel:
        stub = service_pb2_grpc.StrategyServiceStub(channel)
        request = service_pb2.GetStrategyRequest(node="w1", fingerprint=FINGERPRINT)
        with pytest.raises(grpc.RpcError) as info:
            stub.GetStrategy(request, timeout=10, metadata=metadata)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert server.failures() == {}


def test_client_with_wrong_token_gets_service_error(make_server, make_client):
    server = make_server()
    client = make_client(server.port, "w1", job_token="wrong")
    with pytest.raises(ServiceError, match="refused: bad or missing job token"):
        client.fetch_strategy(FINGERPRINT)


def test_fingerprint_mismatch_stops_worker_and_chief(make_server, make_client):
    server = make_server()
    client = make_client(server.port, "w2")
    with pytest.raises(FingerprintMismatchError) as worker_error:
        client.fetch_strategy("fp-worker-9999")
    for text in ("'w2'", "fp-worker-9999", FINGERPRINT, "differs from the chief's"):
        assert text in str(worker_error.value)
    assert worker_error.value.chief_fingerprint == FINGERPRINT
    with pytest.raises(FingerprintMismatchError, match="'w2'") as chief_error:
        server.wait_ready(timeout=10)
    assert chief_error.value.node == "w2"
    assert "fp-worker-9999" in server.failures()["w2"]


def test_barrier_returns_when_all_workers_ready(make_server, make_client):
    server = make_server()
    port = server.port
    clients = [make_client(port, node) for node in ("w1", "w2")]

    def worker(client):
        time.sleep(0.3)  # the chief is already waiting
        client.fetch_strategy(FINGERPRINT)
        client.report_ready()

    threads = [threading.Thread(target=worker, args=(c,)) for c in clients]
    for thread in threads:
        thread.start()
    server.wait_ready(timeout=20)
    for thread in threads:
        thread.join()
    server.check_workers()
    assert server.failures() == {}


def test_barrier_times_out_naming_the_missing_worker(make_server, make_client):
    server = make_server()
    make_client(server.port, "w1").report_ready()
    start = time.monotonic()
    with pytest.raises(ServiceError, match=r"still missing: \['w2'\]"):
        server.wait_ready(timeout=1)
    assert time.monotonic() - start < 5


def test_reported_failure_ends_the_barrier_with_its_message(make_server, make_client):
    server = make_server()
    port = server.port
    make_client(port, "w1").report_ready()
    make_client(port, "w2").report_failed("CUDA out of memory")
    start = time.monotonic()
    with pytest.raises(WorkerFailedError, match="CUDA out of memory") as info:
        server.wait_ready(timeout=30)
    assert info.value.node == "w2"
    assert time.monotonic() - start < 5
    with pytest.raises(WorkerFailedError):
        server.check_workers()


def test_lost_heartbeat_is_reported_within_the_timeout(make_server, make_client):
    server = make_server(nodes=("w1",), heartbeat_timeout=1.0)
    client = make_client(server.port, "w1")
    client.start_heartbeat(interval=0.2)
    client.fetch_strategy(FINGERPRINT)
    client.report_ready()
    server.wait_ready(timeout=10)
    # A beating worker is never reported, even well past the timeout.
    for _ in range(8):
        time.sleep(0.25)
        server.check_workers()
    client.close()  # the worker "dies"
    stopped = time.monotonic()
    with pytest.raises(WorkerFailedError, match=r"'w1'.*no heartbeat for") as info:
        while time.monotonic() - stopped < 10:
            server.check_workers()
            time.sleep(0.05)
    assert info.value.node == "w1"
    assert time.monotonic() - stopped < 1.0 + 2.0
    assert "no heartbeat" in server.failures()["w1"]


def test_worker_notices_a_chief_that_is_gone(make_server, make_client):
    server = make_server(nodes=("w1",))
    client = make_client(server.port, "w1")
    lost = threading.Event()
    client.start_heartbeat(interval=0.1, on_chief_lost=lost.set, lost_after=0.5)
    client.fetch_strategy(FINGERPRINT)
    # A chief that answers is never given up on.
    assert not lost.wait(1.0)
    server.stop()
    assert lost.wait(5.0)


def test_worker_that_reported_done_may_go_silent(make_server, make_client):
    server = make_server(nodes=("w1",), heartbeat_timeout=0.5)
    client = make_client(server.port, "w1")
    client.report_ready()
    client.report_done()
    time.sleep(1.0)
    server.check_workers()


def test_a_chief_ending_after_done_is_no_warning(make_server, make_client, caplog):
    server = make_server(nodes=("w1",))
    client = make_client(server.port, "w1")
    client.start_heartbeat(interval=0.1)
    client.report_ready()
    client.report_done()
    server.stop()  # the job is over: the chief goes away
    time.sleep(0.5)
    assert "Heartbeat" not in caplog.text


def test_never_contacted_worker_is_not_a_lost_heartbeat(make_server):
    server = make_server(nodes=("w1",), heartbeat_timeout=0.2)
    time.sleep(0.5)
    server.check_workers()


def test_unknown_node_is_rejected(make_server, make_client):
    server = make_server()
    client = make_client(server.port, "intruder")
    with pytest.raises(ServiceError, match="'intruder' is not one of the workers"):
        client.fetch_strategy(FINGERPRINT)


def test_port_in_use_raises_service_error(token):
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        sock.listen()
        port = sock.getsockname()[1]
        server = StrategyServer(_strategy(), FINGERPRINT, token, ["w1"], host=HOST, port=port)
        with pytest.raises(ServiceError, match=f"{HOST}:{port}"):
            server.start()
        server.stop()


def test_port_of_a_running_server_raises_service_error(make_server, token):
    # gRPC enables SO_REUSEPORT by default; the server turns it off so that two
    # jobs cannot share a port silently.
    running = make_server()
    server = StrategyServer(_strategy(), FINGERPRINT, token, ["w1"], host=HOST, port=running.port)
    with pytest.raises(ServiceError, match=f"{HOST}:{running.port}"):
        server.start()


def test_unreachable_chief_raises_within_the_timeout(make_client):
    port = _free_port()
    client = make_client(port, "w1", timeout=1.0)
    start = time.monotonic()
    with pytest.raises(ServiceError, match=f"{HOST}:{port}"):
        client.fetch_strategy(FINGERPRINT)
    assert time.monotonic() - start < 5


def test_invalid_arguments_are_rejected(token):
    with pytest.raises(ValueError, match="more than once"):
        StrategyServer(_strategy(), FINGERPRINT, token, ["w1", "w1"])
    with pytest.raises(ValueError, match="token"):
        StrategyServer(_strategy(), FINGERPRINT, "", ["w1"])


def test_a_worker_that_ends_tells_the_chief_how_many_steps_it_ran(make_server, make_client):
    """So that a chief still training can name a worker that ran out of data."""
    server = make_server()
    client = make_client(server.port, "w1")
    client.fetch_strategy(FINGERPRINT)
    client.report_ready()
    client.steps_done = 2
    client.report_done()
    assert server.finished_workers() == {"w1": 2}
