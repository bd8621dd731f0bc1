"""Emulated clusters: rate parsing and spec layout everywhere; namespaces, links and shaping as root.

The root tests build real namespaces (cluster names ``adtest*``, so a user's
``ad`` cluster is never touched) and always remove them, even on failure.
"""
import os
import re
import shutil
import subprocess
import sys

import pytest

from autodist import cli
from autodist.cluster import emulate
from autodist.resource_spec import ResourceSpec

HAVE_IP = shutil.which("ip", path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is not None
needs_root = pytest.mark.skipif(os.geteuid() != 0 or not HAVE_IP,
                                reason="emulated clusters need root and iproute2's ip/tc")
NAME = "adtest"
RATES = ["100mbit", "100mbit", "50mbit"]

# Receives until the sender closes, then prints the goodput in Mbit/s from the first to the last byte.
_SERVER = r"""
import socket, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 0))
s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept()
n, t0 = 0, None
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    t0 = t0 or time.monotonic()
    n += len(b)
print(n * 8 / (time.monotonic() - t0) / 1e6, flush=True)
"""
# Connects to argv[1]:argv[2] and sends for argv[3] seconds.
_CLIENT = r"""
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
buf, end = b"x" * (1 << 16), time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    c.sendall(buf)
c.close()
"""


def _in(host: emulate.EmulatedHost, *argv: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(host.launch_prefix + list(argv), capture_output=True, text=True, timeout=60, **kwargs)


def _send(src: emulate.EmulatedHost, dst: emulate.EmulatedHost, target: str, seconds: float) -> float:
    """Sends from ``src`` to ``dst`` (reached as ``target``) for ``seconds``; returns the Mbit/s received."""
    server = subprocess.Popen(dst.launch_prefix + [sys.executable, "-c", _SERVER],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = server.stdout.readline().strip()
        client = _in(src, sys.executable, "-c", _CLIENT, target, port, str(seconds))
        assert client.returncode == 0, client.stderr
        out, err = server.communicate(timeout=30)
        assert server.returncode == 0, err
        return float(out)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def _our_namespaces(prefix: str = NAME) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix + "-")]


def _our_etc_dirs(prefix: str = NAME) -> list[str]:
    if not os.path.isdir(emulate.NETNS_ETC):
        return []
    return [d for d in os.listdir(emulate.NETNS_ETC) if d.startswith(prefix + "-")]


@pytest.fixture(scope="module")
def cluster():
    """Three hosts, the third on a slower link; removed after the module even if tests fail."""
    emulate.down(NAME)  # leftovers of an interrupted earlier run
    with emulate.emulated_cluster(3, RATES, name=NAME, cpus_per_node=[2, 1, 1]) as c:
        yield c
    assert _our_namespaces() == [] and _our_etc_dirs() == []


# --- Without root --------------------------------------------------------------------------------

@pytest.mark.parametrize("text, gbit", [
    ("1gbit", 1.0), ("500mbit", 0.5), ("2.5gbit", 2.5), ("100Mbit", 0.1), ("1000kbit", 0.001),
    ("1gbps", 8.0), ("1gibit", 2 ** 30 / 1e9), (" 10gbit ", 10.0), (2.5, 2.5)])
def test_parse_rate(text, gbit):
    assert emulate.parse_rate(text) == pytest.approx(gbit)


@pytest.mark.parametrize("bad", ["", "1", "gbit", "1 gigabit", "-1gbit", "0mbit", "1e3mbit", "nan", None, True,
                                 "0.0001kbit"])
def test_parse_rate_rejects(bad):
    with pytest.raises(ValueError, match="Bandwidth"):
        emulate.parse_rate(bad)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_nodes=2, memory="lots"), "Memory 'lots'"),
    (dict(num_nodes=2, memory=["1g", "1g", "1g"]), "one per node"),
    (dict(num_nodes=0), "num_nodes"),
    (dict(num_nodes=254), "num_nodes"),
    (dict(num_nodes=3, bandwidth=["1gbit", "2gbit"]), "one per node"),
    (dict(num_nodes=2, bandwidth="fast"), "tc syntax"),
    (dict(num_nodes=2, cpus_per_node=0), "positive integer"),
    (dict(num_nodes=2, cpus_per_node=[1, 2, 3]), "one per node"),
    (dict(num_nodes=2, name="a-b"), "Cluster name"),
    (dict(num_nodes=2, latency="soon"), "latency"),
])
def test_up_validates_arguments_before_touching_anything(kwargs, match):
    with pytest.raises(ValueError, match=match):
        emulate.up(**kwargs)


def test_up_without_root_says_so(monkeypatch):
    monkeypatch.setattr(emulate.os, "geteuid", lambda: 1000)
    with pytest.raises(emulate.EmulationError, match="need root"):
        emulate.up(2, name=NAME)
    with pytest.raises(emulate.EmulationError, match="need root"):
        emulate.down(NAME)


def test_command_error_names_command_and_stderr():
    with pytest.raises(emulate.CommandError) as info:
        emulate._run([sys.executable, "-c", "import sys; sys.stderr.write('boom'); sys.exit(3)"])
    assert "boom" in str(info.value) and "exit status 3" in str(info.value) and sys.executable in str(info.value)


def test_spec_dict_is_a_valid_resource_spec():
    hosts = (emulate.EmulatedHost("h1", "ad-h1", "10.123.0.1", 1.0, 2),
             emulate.EmulatedHost("h2", "ad-h2", "10.123.0.2", 0.5, 1, 3 * 2 ** 30, "/cg/h2"))
    spec = ResourceSpec.from_dict(emulate.spec_dict(emulate.EmulatedCluster("ad", hosts)))
    assert spec.chief == "10.123.0.1"
    # A capped host's cap is its node's memory, which the compiler checks strategies against.
    assert spec.node("10.123.0.1").memory is None
    assert spec.node("10.123.0.2").memory == 3 * 2 ** 30
    assert spec.network_bandwidth == {"10.123.0.1": 1.0, "10.123.0.2": 0.5}
    assert spec.node("10.123.0.1").cpus == (0, 1)
    assert spec.node("10.123.0.1").launch_prefix == ("ip", "netns", "exec", "ad-h1")
    assert spec.node("10.123.0.2").launch_prefix == tuple(hosts[1].launch_prefix)


@pytest.mark.parametrize("options, message", [
    (["--nodes", "3", "--bandwidth", "1gbit,2gbit"], "one per node"),
    (["--nodes", "2", "--cpus", "x"], "--cpus is 'x'"),
    (["--nodes", "0"], "num_nodes is 0"),
    (["--nodes", "2", "--latency", "soon"], "latency is 'soon'"),
    (["--nodes", "2", "--memory", "3gigs"], "Memory '3gigs'"),
    (["--nodes", "2", "--memory", "1g,2g,3g"], "one per node"),
])
def test_cli_refuses_bad_option_values_as_usage_errors(tmp_path, capsys, options, message):
    # Refused before anything is built (and without root): status 2, as for a value that does not parse.
    out = tmp_path / "spec.yml"
    with pytest.raises(SystemExit) as exited:
        cli.main(["emulate", "up", *options, "--out", str(out)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("autodist emulate up: error: ") and message in err
    assert "Traceback" not in err
    assert not out.exists()


def test_cli_down_refuses_a_bad_name_as_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["emulate", "down", "--name", "ad-h1"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("autodist emulate down: error: ") and "'ad-h1' is invalid" in err
    assert "Traceback" not in err


# --- As root -------------------------------------------------------------------------------------

@pytest.mark.multinode
@needs_root
@pytest.mark.timeout(120)
def test_namespaces_addresses_and_hosts_files(cluster):
    assert [h.namespace for h in cluster.hosts] == ["adtest-h1", "adtest-h2", "adtest-h3"]
    assert sorted(_our_namespaces()) == ["adtest-br", "adtest-h1", "adtest-h2", "adtest-h3"]
    for host in cluster.hosts:
        addr = _in(host, "ip", "-4", "-o", "addr", "show", "dev", "eth0").stdout
        assert f"{host.address}/24" in addr
        assert "UP" in _in(host, "ip", "link", "show", "lo").stdout
        resolved = _in(host, "getent", "hosts", "h3").stdout.split()
        assert resolved[:2] == ["10.123.0.3", "h3"]
    # Nothing of the cluster appears in the root namespace: not its subnet, and none of
    # its interfaces, known by their MAC addresses (the host may have a "br0" of its own).
    assert "10.123.0" not in subprocess.run(["ip", "route"], capture_output=True, text=True).stdout
    bridge = subprocess.run(["ip", "-n", cluster.bridge_namespace, "-o", "link"],
                            capture_output=True, text=True, check=True).stdout
    macs = set(re.findall(r"link/ether ([0-9a-f:]{17})", bridge))
    assert len(macs) >= len(cluster.hosts)  # its ports (the bridge takes one of their MACs)
    root = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert not macs & set(re.findall(r"link/ether ([0-9a-f:]{17})", root))


@pytest.mark.multinode
@needs_root
@pytest.mark.skipif(shutil.which("ping") is None, reason="ping is not installed")
@pytest.mark.timeout(120)
def test_hosts_ping_each_other_by_ip_and_name(cluster):
    h1, h2, h3 = cluster.hosts
    for src, target in [(h1, h2.address), (h1, "h2"), (h2, "h1"), (h3, "h1"), (h1, "adtest-h3")]:
        result = _in(src, "ping", "-c1", "-W2", target)
        assert result.returncode == 0, (src.name, target, result.stdout, result.stderr)


@pytest.mark.multinode
@needs_root
@pytest.mark.timeout(120)
def test_tcp_by_name_runs_at_the_link_rate(cluster):
    h1, h2, _ = cluster.hosts
    mbit = _send(h1, h2, "h2", 2.5)
    assert 80 <= mbit <= 105, mbit
    # The reverse direction is shaped too (the bridge-side end of h1's link).
    mbit = _send(h2, h1, h1.address, 2.0)
    assert 80 <= mbit <= 105, mbit


@pytest.mark.multinode
@needs_root
@pytest.mark.timeout(120)
def test_heterogeneous_rates(cluster):
    h1, _, h3 = cluster.hosts
    assert [h.bandwidth_gbit for h in cluster.hosts] == [0.1, 0.1, 0.05]
    for host, rate in [(h1, "100Mbit"), (h3, "50Mbit")]:
        assert f"rate {rate}" in _in(host, "tc", "qdisc", "show", "dev", "eth0").stdout
        port = f"p{host.name[1:]}"
        bridge_side = subprocess.run(["tc", "-n", cluster.bridge_namespace, "qdisc", "show", "dev", port],
                                     capture_output=True, text=True).stdout
        assert f"rate {rate}" in bridge_side
    # A transfer into the slow host runs at its rate, not the sender's.
    mbit = _send(h1, h3, "h3", 2.5)
    assert 40 <= mbit <= 52.5, mbit


@pytest.mark.multinode
@needs_root
@pytest.mark.timeout(120)
def test_spec_of_a_live_cluster_loads(cluster, tmp_path):
    spec = ResourceSpec.from_dict(emulate.spec_dict(cluster))
    assert spec.node_addresses == ["10.123.0.1", "10.123.0.2", "10.123.0.3"]
    assert spec.chief == "10.123.0.1"
    assert spec.network_bandwidth["10.123.0.3"] == pytest.approx(0.05)
    assert spec.node("10.123.0.1").cpus == (0, 1)
    # The prefix really runs a program on that host.
    prefix = list(spec.node("10.123.0.2").launch_prefix)
    out = subprocess.run(prefix + ["ip", "-4", "-o", "addr", "show", "dev", "eth0"],
                         capture_output=True, text=True, timeout=30).stdout
    assert "10.123.0.2/24" in out


@pytest.mark.multinode
@needs_root
@pytest.mark.timeout(120)
def test_up_refuses_an_existing_cluster(cluster):
    with pytest.raises(emulate.EmulationError, match="already exists.*emulate down --name adtest"):
        emulate.up(2, name=NAME)
    assert sorted(_our_namespaces()) == ["adtest-br", "adtest-h1", "adtest-h2", "adtest-h3"]


@pytest.mark.multinode
@needs_root
@pytest.mark.timeout(120)
def test_down_leaves_nothing_and_tolerates_missing_pieces():
    name = "adtestdown"
    try:
        cluster = emulate.up(2, "200mbit", name=name)
        assert len(_our_namespaces(name)) == 3 and len(_our_etc_dirs(name)) == 2
        # Remove one piece by hand; down must still clean up the rest.
        subprocess.run(["ip", "netns", "delete", cluster.hosts[1].namespace], check=True)
        assert sorted(emulate.down(name)) == ["adtestdown-br", "adtestdown-h1"]
        assert _our_namespaces(name) == [] and _our_etc_dirs(name) == []
        assert emulate.down(name) == []
    finally:
        emulate.down(name)


@pytest.mark.multinode
@needs_root
@pytest.mark.timeout(120)
def test_latency_applies_or_fails_clearly():
    name = "adtestlat"
    try:
        try:
            cluster = emulate.up(2, "1gbit", name=name, latency="5ms")
        except emulate.EmulationError as e:
            assert "sch_netem" in str(e) and "latency" in str(e).lower()
            assert _our_namespaces(name) == [] and _our_etc_dirs(name) == []
            return
        # The kernel has netem: every host's link carries the delay.
        for host in cluster.hosts:
            assert "delay 5ms" in _in(host, "tc", "qdisc", "show", "dev", "eth0").stdout
    finally:
        emulate.down(name)


@pytest.mark.multinode
@needs_root
@pytest.mark.timeout(120)
def test_cli_up_and_down(tmp_path, capsys):
    name, out = "adtestcli", tmp_path / "spec.yml"
    try:
        status = cli.main(["emulate", "up", "--nodes", "2", "--bandwidth", "1gbit", "--bandwidth", "500mbit",
                           "--cpus", "2", "--name", name, "--out", str(out)])
        assert status == 0, capsys.readouterr().err
        printed = capsys.readouterr().out
        assert "adtestcli-h2" in printed and "memory" not in printed
        spec = ResourceSpec(str(out))
        assert spec.network_bandwidth == {"10.123.0.1": 1.0, "10.123.0.2": 0.5}
        assert spec.node("10.123.0.2").cpus == (0, 1)
        assert spec.node("10.123.0.1").launch_prefix == ("ip", "netns", "exec", "adtestcli-h1")
        assert cli.main(["emulate", "up", "--nodes", "2", "--name", name, "--out", str(out)]) == 1
        assert "already exists" in capsys.readouterr().err
    finally:
        assert cli.main(["emulate", "down", "--name", name]) == 0
    assert "Removed" in capsys.readouterr().out
    assert _our_namespaces(name) == [] and _our_etc_dirs(name) == []


@pytest.mark.multinode
@needs_root
@pytest.mark.timeout(120)
def test_python_m_autodist_cli_runs():
    result = subprocess.run([sys.executable, "-m", "autodist.cli", "emulate", "down", "--name", "adtestnone"],
                            capture_output=True, text=True, timeout=110)
    assert result.returncode == 0, result.stderr
    assert "nothing to remove" in result.stdout


# Allocates argv[1] MiB, touching every page, then says so.
_ALLOCATE = r"""
import sys
block = bytearray(int(sys.argv[1]) * 2 ** 20)
block[::4096] = b"x" * len(block[::4096])
print("held", sys.argv[1], flush=True)
"""


@pytest.mark.multinode
@needs_root
@pytest.mark.timeout(120)
def test_a_memory_cap_holds_every_process_of_a_host_and_is_removed_by_down(tmp_path):
    name = "adtestmem"
    emulate.down(name)
    try:
        try:
            cluster = emulate.up(2, "1gbit", name=name, memory=["256m", "1g"])
        except emulate.EmulationError as e:
            assert "memory cgroup" in str(e)
            pytest.skip(f"no memory cgroup controller here: {e}")
        capped, roomy = cluster.hosts
        assert capped.memory_bytes == 256 * 2 ** 20 and roomy.memory_bytes == 2 ** 30
        run = lambda host, mib: subprocess.run(  # noqa: E731
            [*host.launch_prefix, sys.executable, "-c", _ALLOCATE, str(mib)],
            capture_output=True, text=True, timeout=60)
        # Processes started through the prefix run in the host's namespace and cgroup.
        inside = subprocess.run([*capped.launch_prefix, "sh", "-c", "cat /proc/self/cgroup; ip -br addr"],
                                capture_output=True, text=True, timeout=30)
        assert f"autodist-{name}-h1" in inside.stdout and capped.address in inside.stdout
        assert run(capped, 128).stdout.strip() == "held 128"
        over = run(capped, 400)
        assert over.returncode == -9 and "held" not in over.stdout
        assert emulate.oom_kills(capped) >= 1 and emulate.oom_kills(roomy) == 0
        assert run(roomy, 400).stdout.strip() == "held 400"
        # The spec carries the prefix; a user's shell command from the CLI's hint runs it too.
        spec = ResourceSpec.from_dict(emulate.spec_dict(cluster))
        assert spec.node(capped.address).launch_prefix == tuple(capped.launch_prefix)
    finally:
        emulate.down(name)
    assert not os.path.exists(capped.cgroup)
    with open("/proc/self/mounts", encoding="utf-8") as mounts:
        assert emulate.CGROUP_MOUNT not in mounts.read()  # no capped cluster is left
