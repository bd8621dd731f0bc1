"""Multi-node jobs on emulated clusters: real processes, namespaces, TF gRPC servers.

Each job runs tests/cluster_job.py as the chief inside the first namespace; the
chief launches the workers through their launch prefixes.
"""
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import yaml

import cluster_job
import clusters
import test_several_optimizers
from autodist.cluster import emulate
from autodist.strategy import BUILDERS

pytestmark = [pytest.mark.multinode, clusters.needs_root]

JOB = os.path.join(os.path.dirname(__file__), "cluster_job.py")
STEPS = 3
CLIP = 0.3  # below the model's gradient norm at every step: clipping binds


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    yield from clusters.emulated(tmp_path_factory, "adt2", [1, 1])


@pytest.fixture(scope="module")
def three_nodes(tmp_path_factory):
    yield from clusters.emulated(tmp_path_factory, "adt3", [1, 1, 2])


def _run_job(cluster, spec, builder, out, *extra, timeout=150, env=None):
    chief = cluster.hosts[0].launch_prefix
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), **(env or {}))
    return subprocess.run([*chief, sys.executable, JOB, spec, builder, str(out),
                           "--steps", str(STEPS), *extra],
                          capture_output=True, text=True, timeout=timeout, env=env)


def _assert_trained_like_one_device(cluster, out, steps):
    """The chief's saved variables equal single-device training on the global batch."""
    want = cluster_job.reference(sum(h.num_cpus for h in cluster.hosts), steps)
    got = np.load(out)
    for i, expected in enumerate(want):
        np.testing.assert_allclose(got[f"arr_{i}"], expected, rtol=1e-5, atol=1e-5)


def _assert_no_job_left():
    clusters.assert_no_process_left(JOB)


def _assert_every_node_trained(done, cluster, steps: int, builder: str) -> None:
    # Every node trained: each printed its last step.
    for node in range(len(cluster.hosts)):
        assert f"node {node} step {steps - 1} loss" in done.stdout
    # The chief keeps no origin of the nodes' all-reduced copies once all have started.
    dropped, origins = map(int, re.search(r"node 0 dropped (\d+) of (\d+) start-up copies",
                                          done.stdout).groups())
    assert dropped == origins
    assert (origins > 0) == (builder not in ("PS", "PartitionedPS", "PSLoadBalancing",
                                             "UnevenPartitionedPS"))  # no all-reduce


# test_accumulated_gradients_... runs these builders (but HalfScatterGather) on two nodes.
@pytest.mark.timeout(240)
@pytest.mark.parametrize("builder", ["PS", "PartitionedPS", "AllReduce", "Parallax",
                                     "AllReduce-scatter_gather", "Parallax-scatter_gather",
                                     "HalfScatterGather"])
def test_three_node_training_equals_single_device(three_nodes, tmp_path, builder):
    cluster, spec = three_nodes
    out = tmp_path / "variables.npz"
    done = _run_job(cluster, spec, builder, out)
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_trained_like_one_device(cluster, out, STEPS)
    _assert_every_node_trained(done, cluster, STEPS, builder)
    _assert_no_job_left()


def _assert_all_variables_equal(out, want: dict) -> None:
    """The chief's fetch of every global variable (saved by name) equals ``want``."""
    got = np.load(out)
    assert {name.replace("|", "/") for name in got.files} == set(want)
    for name, value in want.items():
        np.testing.assert_allclose(got[name.replace("/", "|")], value, rtol=1e-5, atol=1e-5,
                                   err_msg=name)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("accumulation_steps", [1, 2])
@pytest.mark.parametrize("builder", sorted(BUILDERS) + ["AllReduce-scatter_gather",
                                                        "Parallax-scatter_gather"])
def test_accumulated_gradients_and_every_global_variable_equal_one_device(
        two_nodes, tmp_path, builder, accumulation_steps):
    # 4 runs, each feeding another global batch (but with k = 1: the same one):
    # 4 / k updates, each on k batches (k = 2: the accumulators start over after an
    # update). The chief fetches tf.global_variables().
    cluster, spec = two_nodes
    out = tmp_path / "variables.npz"
    runs = 4
    done = _run_job(cluster, spec, builder, out, "--steps", str(runs), "--all-variables",
                    "--accumulation-steps", str(accumulation_steps))
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_all_variables_equal(out, cluster_job.single_device_state(
        2, runs, accumulation_steps=accumulation_steps))
    _assert_every_node_trained(done, cluster, runs, builder)
    _assert_no_job_left()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("builder", ["PS", "PartitionedPS", "AllReduce"])
def test_clipping_by_global_norm_acts_on_the_averaged_gradients(two_nodes, tmp_path, builder):
    cluster, spec = two_nodes
    out = tmp_path / "variables.npz"
    done = _run_job(cluster, spec, builder, out, "--clip", str(CLIP), "--all-variables")
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_all_variables_equal(out, cluster_job.single_device_state(2, STEPS, clip=CLIP))
    _assert_no_job_left()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("builder", ["PartitionedPS", "AllReduce", "Parallax"])
def test_a_gan_with_two_optimizers_trains_like_one_device(two_nodes, tmp_path, builder):
    cluster, spec = two_nodes
    out = tmp_path / "variables.npz"
    done = _run_job(cluster, spec, builder, out, "--gan", "--optimizer", "adam")
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_all_variables_equal(out, test_several_optimizers.gan_single(
        STEPS, cluster_job.OPTIMIZERS["adam"]))
    _assert_no_job_left()


@pytest.mark.timeout(240)
def test_nodes_summing_their_replicas_first_train_like_one_device(three_nodes, tmp_path):
    # Node 3 has two replicas: with a transfer_destination it pushes their sum.
    cluster, spec = three_nodes
    out = tmp_path / "variables.npz"
    done = _run_job(cluster, spec, "SummedPerNodePS", out)
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_trained_like_one_device(cluster, out, STEPS)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("optimizer, by_rows", [("sgd", True), ("adagrad", True), ("ftrl", True),
                                                ("adam", False)])
@pytest.mark.parametrize("builder", ["Parallax", "SummedPerNodePS"])
def test_proxies_of_a_table_follow_the_rows_its_update_writes(three_nodes, tmp_path, builder,
                                                             optimizer, by_rows):
    """SGD, and tf.compat.v1's Adagrad and FTRL (sparse kernels), write the rows of the
    table's gradient alone: every node refreshes its proxies of the table by those rows.
    Adam writes every row: whole refreshes. Every variable, slots too, is the single-device
    one."""
    cluster, spec = three_nodes
    out = tmp_path / "variables.npz"
    done = _run_job(cluster, spec, builder, out, "--optimizer", optimizer, "--all-variables")
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_all_variables_equal(out, cluster_job.single_device_state(4, STEPS, optimizer=optimizer))
    for node in range(3):
        refreshes = re.search(rf"node {node} refreshes the embedding's proxies by rows (\d+) "
                              r"whole (\d+)", done.stdout)
        rows, whole = int(refreshes.group(1)), int(refreshes.group(2))
        assert (rows > 0 and whole == 0) if by_rows else (rows == 0 and whole > 0), (node, rows, whole)
    _assert_no_job_left()


@pytest.mark.timeout(240)
def test_no_node_reaches_a_tensorflow_server_before_it_listens(three_nodes, tmp_path):
    """Every gRPC channel between the nodes' TF servers connects at its first attempt.

    A channel once refused (its server not started yet) retries only after a
    back-off, and a step's call over it fails at once meanwhile: a node whose
    server started last, and which stepped at once, failed now and then.
    gRPC's subchannel trace shows every connection attempt.
    """
    from autodist.cluster.runtime import tf_port
    cluster, spec = three_nodes
    done = _run_job(cluster, spec, "PartitionedPS", tmp_path / "v.npz",
                    env={"GRPC_VERBOSITY": "INFO", "GRPC_TRACE": "subchannel"})
    assert done.returncode == 0, done.stderr[-3000:]
    tf_channels = [line for line in done.stderr.splitlines()
                   if "subchannel" in line and f":{tf_port()}" in line]
    connected = [line for line in tf_channels if "new connected subchannel" in line]
    assert len(connected) >= 6, "no trace of the channels: did gRPC's trace flags change?"
    refused = [line[:300] for line in tf_channels if "connect failed" in line]
    assert not refused, refused


@pytest.mark.timeout(420)
def test_auto_strategy_searches_with_trials_on_the_cluster(two_nodes, tmp_path):
    """The user's flow: AutoStrategy in the script; its trials are runs of the script itself."""
    import json
    from autodist.strategy import Strategy
    cluster, spec = two_nodes
    out = tmp_path / "variables.npz"
    done = _run_job(cluster, spec, "AutoStrategy", out, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    trials = [json.loads(line) for line in
              (tmp_path / "search" / "trials.jsonl").read_text().splitlines()]
    assert len(trials) == 4 and all(t["error"] == "" and t["measured_s"] > 0 for t in trials)
    best = Strategy.load(str(tmp_path / "search" / "best.strategy"))
    assert best.id == min(trials, key=lambda t: t["measured_s"])["strategy_id"]
    assert len(best.replicas) == 2
    # Each trial ran the job's own steps (1 warm-up + 2 timed; the last ends the job).
    for trial in range(1, 5):
        log = (tmp_path / "search" / "trials" / f"trial-{trial:03d}.log").read_text()
        assert "node 0 step 1 loss" in log and "node 0 step 2" not in log
    # After the search the job trained with the result, exactly as one device would.
    _assert_trained_like_one_device(cluster, out, STEPS)
    _assert_no_job_left()


@pytest.mark.timeout(300)
def test_checkpoint_of_a_cluster_job_resumes_under_another_strategy(three_nodes, tmp_path):
    """Parallax on 3 nodes saves; plain TF restores it; AllReduce resumes from it."""
    import tensorflow as tf
    cluster, spec = three_nodes
    checkpoint = str(tmp_path / "ckpt" / "model")
    first = _run_job(cluster, spec, "Parallax", tmp_path / "first.npz", "--save", checkpoint)
    assert first.returncode == 0, first.stderr[-3000:]
    reader = tf.train.load_checkpoint(checkpoint)
    trained = np.load(tmp_path / "first.npz")
    for i, name in enumerate(["embedding", "w1", "w2"]):
        np.testing.assert_array_equal(reader.get_tensor(name), trained[f"arr_{i}"])
    assert reader.get_tensor("global_step") == STEPS
    assert {"embedding/Adam", "w1/Adam_1", "beta1_power"} <= set(reader.get_variable_to_shape_map())

    second = _run_job(cluster, spec, "AllReduce", tmp_path / "second.npz", "--restore", checkpoint)
    assert second.returncode == 0, second.stderr[-3000:]
    _assert_trained_like_one_device(cluster, tmp_path / "second.npz", 2 * STEPS)
    _assert_no_job_left()


@pytest.mark.timeout(240)
def test_a_killed_worker_is_reported_by_name(two_nodes, tmp_path):
    cluster, spec = two_nodes
    done = _run_job(cluster, spec, "AllReduce", tmp_path / "v.npz", "--die-at", "1")
    ended = time.time()
    assert done.returncode != 0
    worker = cluster.hosts[1].address
    assert "WorkerFailedError" in done.stderr and worker in done.stderr, done.stderr[-3000:]
    assert "killed by SIGKILL (the kernel's out-of-memory killer" in done.stderr
    died = float(re.search(r"node 1 dies at ([0-9.]+)", done.stdout).group(1))
    assert ended - died < 30, f"the chief took {ended - died:.1f} s to report the dead worker"
    _assert_no_job_left()


@pytest.mark.timeout(240)
def test_a_worker_with_another_graph_is_refused(two_nodes, tmp_path):
    cluster, spec = two_nodes
    done = _run_job(cluster, spec, "PS", tmp_path / "v.npz", "--mismatch")
    assert done.returncode != 0
    assert "FingerprintMismatchError" in done.stderr
    assert cluster.hosts[1].address in done.stderr and "differs from the chief" in done.stderr
    _assert_no_job_left()


@pytest.mark.timeout(240)
def test_unseeded_keras_model_starts_from_the_chiefs_values(two_nodes):
    """The README's example: Keras layers with unseeded initializers, on two nodes.

    Each process draws other random initial values; the workers' copies must
    start from the chief's, so both nodes report the same losses.
    """
    cluster, spec = two_nodes
    example = os.path.join(os.path.dirname(__file__), "..", "examples", "train_mlp.py")
    done = subprocess.run([*cluster.hosts[0].launch_prefix, sys.executable, example,
                           "--spec", spec, "--builder", "AllReduce", "--steps", "4"],
                          capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert done.returncode == 0, done.stderr[-3000:]
    losses = re.findall(r"step +(\d+) +loss ([0-9.]+)", done.stdout)
    by_step = {}
    for step, loss in losses:
        by_step.setdefault(int(step), []).append(loss)
    assert sorted(by_step) == [0, 1, 2, 3]
    for step, values in by_step.items():
        assert len(values) == 2 and values[0] == values[1], (step, values)
    _assert_no_job_left()


@pytest.mark.timeout(180)
def test_a_node_that_cannot_be_started_is_named(two_nodes, tmp_path):
    """A launch that fails (here: a namespace that does not exist) is an error, not a hang."""
    cluster, spec = two_nodes
    import yaml
    broken = yaml.safe_load(open(spec))
    broken["nodes"][1]["launch_prefix"] = ["ip", "netns", "exec", "adt-no-such-host"]
    broken_spec = tmp_path / "broken.yml"
    broken_spec.write_text(yaml.safe_dump(broken))
    start = time.monotonic()
    done = _run_job(cluster, str(broken_spec), "PS", tmp_path / "v.npz")
    assert done.returncode != 0
    assert "WorkerFailedError" in done.stderr and cluster.hosts[1].address in done.stderr
    assert time.monotonic() - start < 90
    _assert_no_job_left()


def _signal_chief_while_training(cluster, spec, tmp_path, builder, signum,
                                 while_training=None, extra=()) -> int:
    """Starts a long job, waits until both nodes train, signals the chief; its exit code.

    The chief's standard error goes to ``tmp_path / "chief.err"``, the monotonic
    time just before the signal to ``tmp_path / "signalled_at"``. ``while_training()``,
    if given, runs once both nodes train, before the signal. ``extra``: more
    arguments of cluster_job.py.
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    # A process started in the background by a non-interactive shell ignores SIGINT,
    # and its children inherit that (Python then raises no KeyboardInterrupt); a
    # handler here instead becomes the default one in the chief.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        chief = subprocess.Popen([*cluster.hosts[0].launch_prefix, sys.executable, "-u", JOB,
                                  spec, builder, str(tmp_path / "v.npz"), "--steps", "100000",
                                  *extra],
                                 stdout=subprocess.PIPE, stderr=open(tmp_path / "chief.err", "w"),
                                 text=True, env=env)
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        seen = set()
        deadline = time.monotonic() + 120
        while len(seen) < 2 and time.monotonic() < deadline:
            match = re.match(r"node (\d) step", chief.stdout.readline())
            if match:
                seen.add(match.group(1))
        assert seen == {"0", "1"}
        if while_training is not None:
            while_training()
        signalled = time.monotonic()
        chief.send_signal(signum)
        (tmp_path / "signalled_at").write_text(repr(signalled))
        return chief.wait(timeout=60)
    finally:
        if chief.poll() is None:
            chief.kill()


@pytest.mark.timeout(180)
def test_ctrl_c_on_the_chief_stops_every_worker(two_nodes, tmp_path):
    assert _signal_chief_while_training(*two_nodes, tmp_path, "AllReduce", signal.SIGINT) != 0
    time.sleep(1)
    _assert_no_job_left()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("builder", ["AllReduce", "PartitionedPS"])
def test_a_partition_between_two_workers_is_named_not_a_hang(three_nodes, tmp_path, builder):
    """Both workers still reach the chief, so heartbeats go on; their step does not.

    The chief's watchdog names the nodes still in the step once it exceeds its
    bound; where TensorFlow itself notices the broken link first, a worker fails
    and the chief names it. Either way: an error within 60 s, no process left.
    """
    cluster, spec = three_nodes
    h1, h2, h3 = cluster.hosts
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    chief = subprocess.Popen([*h1.launch_prefix, sys.executable, "-u", JOB, spec, builder,
                              str(tmp_path / "v.npz"), "--steps", "100000"],
                             stdout=subprocess.PIPE, stderr=open(tmp_path / "chief.err", "w"),
                             text=True, env=env)
    routes = [(h2, h3), (h3, h2)]
    try:
        seen, deadline = set(), time.monotonic() + 120
        while len(seen) < 3 and time.monotonic() < deadline:
            match = re.match(r"node (\d) step (\d+)", chief.stdout.readline())
            if match and int(match.group(2)) >= 5:  # a few steps: the bound knows the step time
                seen.add(match.group(1))
        assert seen == {"0", "1", "2"}
        for here, there in routes:
            subprocess.run(["ip", "netns", "exec", here.namespace, "ip", "route", "add",
                            "blackhole", f"{there.address}/32"], check=True)
        partitioned = time.monotonic()
        threading.Thread(target=chief.stdout.read, daemon=True).start()  # drain
        code = chief.wait(timeout=90)
        assert time.monotonic() - partitioned < 60
        assert code != 0
        error = (tmp_path / "chief.err").read_text()
        if "nodes still in it" in error:  # the chief's watchdog saw the step hang
            named = error.split("nodes still in it")[1].split("]")[0]
        else:  # or TensorFlow noticed the broken link on a worker, which reported it
            assert "WorkerFailedError" in error, error[-3000:]
            named = error.split("WorkerFailedError")[-1]
        assert h2.address in named or h3.address in named, error[-3000:]
    finally:
        if chief.poll() is None:
            chief.kill()
        for here, there in routes:
            subprocess.run(["ip", "netns", "exec", here.namespace, "ip", "route", "del",
                            "blackhole", f"{there.address}/32"], capture_output=True)
    time.sleep(2)
    _assert_no_job_left()


def _read_proc(pid: str, name: str) -> str:
    """/proc/PID/NAME with its NUL separators as spaces; "" once the process has ended."""
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("wrapper", [[], ["timeout", "600"]], ids=["netns", "timeout-netns"])
def test_the_job_token_is_on_no_command_line(two_nodes, tmp_path, wrapper):
    """Any user of a node sees every process's command line; the token must not be there.

    A launch prefix other than a plain ``ip netns exec`` (here ``timeout 600``
    before it) stays a process whose command line holds the worker's command.
    The token reaches the worker on its standard input, not in its environment.
    """
    import yaml
    cluster, spec = two_nodes
    wrapped = yaml.safe_load(open(spec))
    wrapped["nodes"][1]["launch_prefix"] = wrapper + wrapped["nodes"][1]["launch_prefix"]
    (tmp_path / "spec.yml").write_text(yaml.safe_dump(wrapped))
    token_file = tmp_path / "token"
    seen = {}

    def look():
        seen["token"] = token_file.read_text()
        # /proc rather than ps: ps cuts long lines to the terminal's width (COLUMNS).
        pids = [path.split("/")[2] for path in glob.glob("/proc/[0-9]*/cmdline")]
        seen["command lines"] = {pid: _read_proc(pid, "cmdline") for pid in pids}
        seen["environments"] = {pid: _read_proc(pid, "environ") for pid, line
                                in seen["command lines"].items() if JOB in line}

    _signal_chief_while_training(cluster, str(tmp_path / "spec.yml"), tmp_path, "PS",
                                 signal.SIGINT, while_training=look,
                                 extra=["--token-file", str(token_file)])
    token, lines, environments = seen["token"], seen["command lines"], seen["environments"]
    assert len(token) == 32
    assert not [line for line in lines.values() if token in line]
    assert not [env for env in environments.values() if token in env]
    pythons = [pid for pid in environments if lines[pid].startswith(sys.executable)]
    assert len(pythons) == 2  # the chief and the worker
    if wrapper:
        assert [line for line in lines.values()
                if line.startswith("timeout 600 ip netns exec") and JOB in line]
    worker = [pid for pid in pythons if "AUTODIST_WORKER=" in environments[pid]]
    assert len(worker) == 1 and "AUTODIST_SECRETS_ON_STDIN=1" in environments[worker[0]]
    _assert_no_job_left()


@pytest.mark.timeout(180)
def test_sigterm_on_the_chief_stops_the_job_at_once_and_says_so(two_nodes, tmp_path):
    """SIGTERM is what kill, Slurm and Kubernetes send: it must not leave workers behind.

    Every job process, the chief included, is gone within 5 s of the signal.
    """
    code = _signal_chief_while_training(*two_nodes, tmp_path, "AllReduce", signal.SIGTERM)
    signalled = float((tmp_path / "signalled_at").read_text())
    assert code == 128 + signal.SIGTERM
    assert "the chief received SIGTERM; stopped the job" in (tmp_path / "chief.err").read_text()
    while True:
        left = clusters.processes_running(JOB)
        after = time.monotonic() - signalled  # the processes were looked at before this
        if not left or after > 5:
            break
        time.sleep(0.2)
    assert not left and after <= 5, f"job processes {left} {after:.1f} s after SIGTERM"


@pytest.mark.timeout(180)
def test_a_chief_killed_outright_takes_its_workers_with_it(two_nodes, tmp_path):
    """SIGKILL leaves the chief no chance to stop its workers; the kernel ends them."""
    _signal_chief_while_training(*two_nodes, tmp_path, "PS", signal.SIGKILL)
    time.sleep(2)  # well below the 30 s after which an orphan notices the silent chief
    _assert_no_job_left()


OUTSIDER = """
import socket, sys
import tensorflow as tf
chief, worker, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
for address in (chief, worker):
    try:
        socket.create_connection((address, port), timeout=5).close()
        print("connected", address)
    except OSError as err:
        print("refused", address, type(err).__name__)
config = tf.compat.v1.ConfigProto(operation_timeout_in_ms=10000)
try:
    with tf.compat.v1.Session(f"grpc://{chief}:{port}", config=config) as session:
        with tf.device("/job:worker/task:0"):
            session.run(tf.constant(1.0))
    print("session ran")
except tf.errors.OpError as err:
    print("session failed", type(err).__name__)
"""


def _rules_of_the_job(host) -> list:
    """The lines of a host's packet-filter rules that AutoDist set."""
    rules = subprocess.run([*host.launch_prefix, "iptables", "-S"], capture_output=True,
                           text=True).stdout
    return [line for line in rules.splitlines() if "AUTODIST-" in line]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("ends_first", ["worker", "chief"])
def test_a_node_that_runs_out_of_data_is_named(two_nodes, tmp_path, ends_first):
    """One node's script ends after 2 steps of 6: the node waiting for it in step 3 names
    it at once, not as a stuck step, and the job fails."""
    cluster, spec = two_nodes
    started = time.monotonic()
    done = _run_job(cluster, spec, "AllReduce", tmp_path / "v.npz", "--steps", "6",
                    f"--{ends_first}-steps", "2")
    assert done.returncode != 0
    chief, worker = (host.address for host in cluster.hosts)
    left, waiting = (worker, "the chief") if ends_first == "worker" else (chief, f"node {worker!r}")
    assert (f"NodeLeftError: AutoDist: node '{left}' finished its script after 2 training "
            f"steps, while {waiting} waits for it in step 3") in done.stderr, done.stderr[-2000:]
    if ends_first == "chief":  # the chief's own output says why the job failed
        assert "AutoDist: the chief's script ended, but" in done.stderr, done.stderr[-2000:]
    assert "StuckStepError" not in done.stderr
    assert "has not answered" not in done.stderr
    assert time.monotonic() - started < 60  # not the stuck-step bound of the first steps
    _assert_no_job_left()


@pytest.mark.timeout(240)
@pytest.mark.skipif(not shutil.which("iptables"), reason="iptables is not installed")
def test_only_the_jobs_nodes_reach_its_tensorflow_servers(three_nodes, tmp_path):
    """A host on the job's network but not in its spec cannot open a session to any of
    the job's TensorFlow servers while it trains; a kill -9 of the chief leaves no rule."""
    from autodist.cluster.runtime import tf_port
    cluster, _ = three_nodes
    port = tf_port()
    job_hosts, outsider = cluster.hosts[:2], cluster.hosts[2]
    spec = tmp_path / "two_of_three.yml"
    nodes = emulate.spec_dict(cluster)["nodes"][:2]
    spec.write_text(yaml.safe_dump({"nodes": nodes}))
    seen = {}

    def while_training():
        for host in job_hosts:
            seen[host.address] = _rules_of_the_job(host)
        seen["outsider"] = subprocess.run(
            [*outsider.launch_prefix, sys.executable, "-c", OUTSIDER, job_hosts[0].address,
             job_hosts[1].address, str(port)], capture_output=True, text=True, timeout=90,
            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")).stdout

    _signal_chief_while_training(cluster, str(spec), tmp_path, "AllReduce", signal.SIGKILL,
                                 while_training=while_training)
    for host in job_hosts:
        assert any(line.startswith(f"-A INPUT -p tcp -m tcp --dport {port} -j AUTODIST-{port}-")
                   for line in seen[host.address]), seen[host.address]
        assert f"-s {host.address}/32 -j ACCEPT" in " ".join(seen[job_hosts[0].address])
    for address in (job_hosts[0].address, job_hosts[1].address):
        assert f"refused {address} ConnectionRefusedError" in seen["outsider"], seen["outsider"]
    assert "session failed" in seen["outsider"] and "session ran" not in seen["outsider"]
    # The chief's guardian, and the worker's, remove their rules once their node is gone,
    # and end.
    chains = {re.search(r"-j (AUTODIST-\S+)", line).group(1)
              for lines in (seen[h.address] for h in job_hosts) for line in lines
              if line.startswith("-A INPUT")}
    assert len(chains) == 2

    def left():
        return ([h.address for h in job_hosts if _rules_of_the_job(h)]
                + [p for chain in chains for p in clusters.processes_running(chain)])

    deadline = time.monotonic() + 10
    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left()
    _assert_no_job_left()


# Two AutoDist instances on the cluster in one process, the second made before the first
# trains or after it trained (a notebook's next cell). Every process says when it starts.
_TWO_JOBS = """
import os, sys
import numpy as np
import tensorflow as tf
from autodist import AutoDist
from autodist.strategy import AllReduce
tf1 = tf.compat.v1


def say(line):
    # One write per line: the chief and its worker share this file, and print()'s pieces
    # can interleave with the other process's.
    os.write(1, (line + "\\n").encode())


say("process starts as " + os.environ.get("AUTODIST_WORKER", "the chief"))


def train(ad, name):
    with tf.Graph().as_default(), ad.scope():
        x = tf1.placeholder(tf.float32, [None, 2])
        w = tf1.get_variable("w", [2, 1], use_resource=True, initializer=tf1.zeros_initializer())
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - 1.0))
        step = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
        session = ad.create_distributed_session()
        for _ in range(2):
            session.run(step, {x: np.ones((2, 2), np.float32)})
    say(f"{name} job trained on node {ad.node_index}")


spec, second_made = sys.argv[1], sys.argv[2]
first = AutoDist(spec, AllReduce())
if second_made == "before":
    second = AutoDist(spec, AllReduce())
train(first, "first")
if second_made == "after":
    second = AutoDist(spec, AllReduce())
train(second, "second")
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("second_made", ["before", "after"])
def test_a_second_job_in_one_process_is_refused_before_it_launches_a_worker(two_nodes, tmp_path,
                                                                            second_made):
    """A process runs one multi-node job: the chief refuses the second by name, launching
    no worker for it; no worker says anything misleading or outlives the chief."""
    cluster, spec = two_nodes
    job = tmp_path / "two_jobs_in_one_process.py"
    job.write_text(_TWO_JOBS)
    out, err = tmp_path / "out", tmp_path / "err"
    # Output to files, not pipes: the workers share them, and a pipe's reader would wait
    # for the last worker to end, not for the chief.
    with open(out, "w") as stdout, open(err, "w") as stderr:
        code = subprocess.run([*cluster.hosts[0].launch_prefix, sys.executable, str(job), spec,
                               second_made], stdout=stdout, stderr=stderr, timeout=200,
                              env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
                              ).returncode
    clusters.assert_no_process_left(str(job))  # at once: no worker outlives the chief
    printed, said = out.read_text(), err.read_text()
    assert code != 0
    assert printed.count("process starts as") == 2, printed  # the first job's two
    assert "first job trained on node 0" in printed and "second job" not in printed
    chief = cluster.hosts[0].address
    assert (f"RuntimeError: AutoDist: this process already joined a multi-node job (as node "
            f"{chief!r}, the chief)") in said, said[-3000:]
    assert "Start each multi-node job in a new process" in said
    for misleading in ("did not arrive on standard input", "cannot start its TensorFlow server",
                       "FingerprintMismatchError"):
        assert misleading not in said, said[-3000:]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("unresolved_on", [None, 0, 1])
def test_a_node_that_cannot_resolve_a_peers_name_says_so_at_start(two_nodes, tmp_path,
                                                                  unresolved_on):
    """A spec naming its nodes by host name; one node's hosts file lacks the other's."""
    cluster, spec = two_nodes
    named = yaml.safe_load(open(spec))
    for node, host in zip(named["nodes"], cluster.hosts):
        node["address"] = host.name
    named_spec = tmp_path / "named.yml"
    named_spec.write_text(yaml.safe_dump(named))
    hosts_file = os.path.join(emulate.NETNS_ETC, cluster.hosts[unresolved_on or 0].namespace,
                              "hosts")
    original = open(hosts_file).read()
    peer = cluster.hosts[1 - (unresolved_on or 0)]
    if unresolved_on is not None:
        with open(hosts_file, "w") as f:
            f.writelines(line for line in original.splitlines(keepends=True)
                         if peer.name not in line.split()[1:])
    try:
        started = time.monotonic()
        done = _run_job(cluster, str(named_spec), "AllReduce", tmp_path / "v.npz")
        seconds = time.monotonic() - started
    finally:
        with open(hosts_file, "w") as f:
            f.write(original)
    _assert_no_job_left()
    if unresolved_on is None:  # the names work where they resolve
        assert done.returncode == 0, done.stderr[-3000:]
        _assert_trained_like_one_device(cluster, tmp_path / "v.npz", STEPS)
        return
    node = cluster.hosts[unresolved_on]
    role = "the chief" if unresolved_on == 0 else "a worker"
    assert done.returncode != 0
    assert (f"node '{node.name}' ({role}, this machine) cannot resolve the address "
            f"'{peer.name}' of node '{peer.name}'") in done.stderr, done.stderr[-3000:]
    assert f"Add '{peer.name}' to this machine's /etc/hosts" in done.stderr
    if unresolved_on == 1:  # the chief names its failed worker too
        assert f"Worker node '{node.name}' failed" in done.stderr, done.stderr[-3000:]
    assert "did not accept connections" not in done.stderr
    assert seconds < 60, f"{seconds:.0f} s to name it"


# A replicated 512 MB table, more than a 600 MB host holds beside TensorFlow itself.
_BIG_TABLE_JOB = """
import sys
import numpy as np
import tensorflow as tf
from autodist import AutoDist
from autodist.strategy import AllReduce
tf1 = tf.compat.v1
ad = AutoDist(resource_spec_file=sys.argv[1], strategy_builder=AllReduce())
with tf.Graph().as_default(), ad.scope():
    ids = tf1.placeholder(tf.int32, [None], name="ids")
    table = tf1.get_variable("table", [2 ** 19, 256], use_resource=True,
                             initializer=tf1.zeros_initializer())
    loss = tf.reduce_sum(tf.gather(table, ids))
    train = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    sess = ad.create_distributed_session()
    sess.run(train, {ids: np.arange(4, dtype=np.int32)})
"""


@pytest.mark.timeout(240)
def test_a_worker_over_its_hosts_memory_cap_is_reported_as_out_of_memory(tmp_path):
    name = "adtmem"
    emulate.down(name)
    try:
        cluster = emulate.up(2, "1gbit", name=name, memory=["16g", "600m"])
    except emulate.EmulationError as e:
        if "needs a memory cgroup controller" not in str(e):
            raise
        pytest.skip(f"no memory cgroup controller here: {e}")
    spec, job = tmp_path / "spec.yml", tmp_path / "big_table_job.py"
    spec.write_text(yaml.safe_dump(emulate.spec_dict(cluster)))
    job.write_text(_BIG_TABLE_JOB)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    try:
        done = subprocess.run([*cluster.hosts[0].launch_prefix, sys.executable, str(job), str(spec)],
                              capture_output=True, text=True, timeout=200, env=env)
        kills = [emulate.oom_kills(host) for host in cluster.hosts]
    finally:
        emulate.down(name)
    assert done.returncode != 0
    assert "WorkerFailedError" in done.stderr and cluster.hosts[1].address in done.stderr, \
        done.stderr[-3000:]
    assert "killed by SIGKILL (the kernel's out-of-memory killer" in done.stderr
    assert kills[0] == 0 and kills[1] >= 1, kills
    clusters.assert_no_process_left(str(job))
