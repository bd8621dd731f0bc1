"""``autodist probe``: link measurements on loopback everywhere, against tc-shaped links as root.

The root tests build an emulated cluster named ``adprobe`` (so no other test's
or user's cluster is touched) and always remove it.
"""
import json
import os
import shutil
import time

import pytest
import yaml

from autodist import cli
from autodist.cluster import emulate, probe
from autodist.resource_spec import ResourceSpec

HAVE_IP = shutil.which("ip", path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is not None
needs_root = pytest.mark.skipif(os.geteuid() != 0 or not HAVE_IP,
                                reason="emulated clusters need root and iproute2's ip/tc")
NAME = "adprobe"
RATES = ["200mbit", "200mbit", "50mbit"]
TOLERANCE = 0.15  # TCP/IP headers alone make goodput ~4% below the tc rate


def _loopback_spec(**second_node) -> ResourceSpec:
    """Two "nodes" on this machine: the chief at localhost, the other at 127.0.0.1."""
    return ResourceSpec.from_dict({"nodes": [{"address": "localhost", "chief": True},
                                             {"address": "127.0.0.1", **second_node}]}, "loopback")


def _write(path, spec_dict: dict) -> str:
    path.write_text(yaml.safe_dump(spec_dict, sort_keys=False))
    return str(path)


# --- Without root: both programs on this machine ---------------------------------------------------

@pytest.mark.timeout(60)
def test_probe_over_loopback():
    (m,) = probe.probe(_loopback_spec(), seconds=0.3, pings=5)
    assert m.address == "127.0.0.1"
    assert 0 < m.latency_ms < 50
    assert m.to_node_gbit > 0.1 and m.from_node_gbit > 0.1
    assert m.bandwidth_gbit == min(m.to_node_gbit, m.from_node_gbit)


def test_measured_spec_rounds_and_gives_the_chief_its_fastest_link():
    spec = ResourceSpec.from_dict({"nodes": [
        {"address": "a", "chief": True, "launch_prefix": ["x"]},
        {"address": "b", "launch_prefix": ["y"], "cpus": [0, 1]},
        {"address": "c", "launch_prefix": ["z"], "network_bandwidth": 7}]})
    measured = [probe.LinkMeasurement("b", 0.1, 0.123456, 0.2),
                probe.LinkMeasurement("c", 0.2, 0.0481234, 0.0479)]
    out = probe.measured_spec(spec, measured)
    assert [n["network_bandwidth"] for n in out["nodes"]] == [0.123, 0.123, 0.0479]
    assert "ssh" not in out
    again = ResourceSpec.from_dict(out)
    assert again.node("b").cpus == (0, 1) and again.node("c").launch_prefix == ("z",)
    assert spec.node("c").network_bandwidth == 7  # the input is not changed
    table = probe.format_table(spec, measured)
    assert "(chief)" in table and "0.123 Gbit/s" in table and "0.0479 Gbit/s" in table


@pytest.mark.parametrize("kwargs, match", [
    (dict(seconds=0), "seconds"), (dict(seconds=61), "seconds"), (dict(pings=0), "pings"),
    (dict(pings=2.5), "pings"), (dict(pings=True), "pings"), (dict(timeout=-1), "timeout"),
    (dict(timeout=float("inf")), "timeout"), (dict(seconds=True), "seconds")])
def test_probe_validates_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        probe.probe(_loopback_spec(), **kwargs)


def test_single_node_spec_has_nothing_to_measure():
    spec = ResourceSpec.from_dict({"nodes": [{"address": "localhost"}]}, "one.yml")
    with pytest.raises(ValueError, match="'one.yml' has a single node"):
        probe.probe(spec)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("prefix, match", [
    (["/nonexistent/launcher"], r"Node '127\.0\.0\.1': could not start the probe with '/nonexistent/launcher'"),
    (["sh", "-c", "echo no such host >&2; exit 3", "sh"],
     r"Node '127\.0\.0\.1': the probe server exited with status 3 .*it said: no such host"),
    (["sh", "-c", "sleep 60", "sh"], r"Node '127\.0\.0\.1': the probe server did not answer within 2 s"),
])
def test_a_node_that_does_not_start_is_named(prefix, match):
    start = time.monotonic()
    with pytest.raises(probe.ProbeError, match=match):
        probe.probe(_loopback_spec(launch_prefix=prefix), seconds=0.2, timeout=2)
    assert time.monotonic() - start < 15


@pytest.mark.timeout(60)
def test_cli_writes_the_spec_and_a_report(tmp_path, capsys):
    source = _write(tmp_path / "spec.yml", {"nodes": [{"address": "localhost", "chief": True, "cpus": [0, 1]},
                                                      {"address": "127.0.0.1", "network_bandwidth": 1}]})
    original = open(source).read()
    out, report = tmp_path / "out.yml", tmp_path / "report.json"
    assert cli.main(["probe", source, "--out", str(out), "--seconds", "0.3", "--report", str(report)]) == 0
    printed = capsys.readouterr().out
    assert "127.0.0.1" in printed and " ms " in printed and f"Wrote network_bandwidth to {out}" in printed
    assert open(source).read() == original
    spec = ResourceSpec(str(out))
    assert spec.node("localhost").cpus == (0, 1)
    data = json.loads(report.read_text())
    (node,) = data["nodes"]
    assert node["address"] == "127.0.0.1" and node["latency_ms"] > 0
    assert spec.network_bandwidth["127.0.0.1"] == pytest.approx(node["bandwidth_gbit"], rel=0.01)
    # Without --out the spec is updated in place.
    assert cli.main(["probe", source, "--seconds", "0.2"]) == 0
    assert ResourceSpec(source).network_bandwidth["127.0.0.1"] != 1


def test_cli_reports_failures_on_one_line(tmp_path, capsys):
    source = _write(tmp_path / "spec.yml", {"nodes": [{"address": "localhost", "chief": True},
                                                      {"address": "127.0.0.1", "launch_prefix": ["/nonexistent"]}]})
    original = open(source).read()
    assert cli.main(["probe", source, "--timeout", "2"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("autodist probe: error: Node '127.0.0.1'") and "\n" not in err
    assert open(source).read() == original


@pytest.mark.parametrize("option, value, message", [
    ("--seconds", "0", "seconds is 0.0, but it must be a number above 0 and at most 60.0."),
    ("--pings", "1001", "pings is 1001, but it must be an integer from 1 to 1000."),
    ("--timeout", "-1", "timeout is -1.0, but it must be a positive, finite number of seconds."),
    ("--timeout", "inf", "timeout is inf, but it must be a positive, finite number of seconds."),
    # The outputs are checked before any node is measured, not after.
    ("--out", "/nonexistent/spec.yml",
     "--out /nonexistent/spec.yml: its directory /nonexistent does not exist."),
    ("--report", "/", "--report / is a directory; give the path of a file."),
])
def test_cli_refuses_an_option_out_of_range_as_a_usage_error(tmp_path, capsys, option, value, message):
    # A launch route that fails at once: the options are refused before any node is started.
    source = _write(tmp_path / "spec.yml", {"nodes": [{"address": "localhost", "chief": True},
                                                      {"address": "127.0.0.1", "launch_prefix": ["/nonexistent"]}]})
    with pytest.raises(SystemExit) as exited:
        cli.main(["probe", source, option, value])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == f"autodist probe: error: {message}"
    assert "Traceback" not in err


def _refused_before_measuring(tmp_path, capsys, out: str) -> str:
    """The usage error ``autodist probe --out out`` ends with, on a spec whose node fails at
    once: a probe that measured first would name that node instead."""
    source = _write(tmp_path / "spec.yml", {"nodes": [{"address": "localhost", "chief": True},
                                                      {"address": "127.0.0.1", "launch_prefix": ["/nonexistent"]}]})
    with pytest.raises(SystemExit) as exited:
        cli.main(["probe", source, "--out", out])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.splitlines()[-1]


def test_an_out_path_whose_files_cannot_be_made_is_named_before_measuring(tmp_path, capsys):
    out = str(tmp_path / ("n" * 250 + ".yml"))  # a name the temporary beside it cannot extend
    assert _refused_before_measuring(tmp_path, capsys, out) == (
        f"autodist probe: error: --out {out} cannot be written: making a file beside it "
        "failed (File name too long).")


# --- As root: an emulated cluster with tc-shaped links ---------------------------------------------

@pytest.fixture(scope="module")
def cluster():
    """Three hosts, the third on a slower link; removed after the module even if tests fail."""
    emulate.down(NAME)  # leftovers of an interrupted earlier run
    with emulate.emulated_cluster(3, RATES, name=NAME) as c:
        yield c


@pytest.mark.multinode
@needs_root
@pytest.mark.timeout(180)
def test_probe_measures_the_tc_rates(cluster, tmp_path, capsys):
    spec_dict = emulate.spec_dict(cluster)
    for node in spec_dict["nodes"]:
        node["network_bandwidth"] = 1.0  # so the test sees the probe's values, not emulate's
    path = _write(tmp_path / "spec.yml", spec_dict)
    report = tmp_path / "report.json"
    assert cli.main(["probe", path, "--seconds", "1.5", "--report", str(report)]) == 0, capsys.readouterr().err
    print(capsys.readouterr().out)  # the table, for -s runs
    spec = ResourceSpec(path)
    expected = {h.address: h.bandwidth_gbit for h in cluster.hosts}  # the chief's link is the fastest
    for address, gbit in spec.network_bandwidth.items():
        assert gbit == pytest.approx(expected[address], rel=TOLERANCE), (address, gbit)
    assert spec.node(cluster.hosts[2].address).launch_prefix == tuple(cluster.hosts[2].launch_prefix)
    assert spec.chief == cluster.hosts[0].address
    for node in json.loads(report.read_text())["nodes"]:
        for direction in ("to_node_gbit", "from_node_gbit"):
            assert node[direction] == pytest.approx(expected[node["address"]], rel=TOLERANCE), node
        assert 0 < node["latency_ms"] < 20


@pytest.mark.multinode
@needs_root
@pytest.mark.timeout(180)
def test_a_node_whose_namespace_is_missing_is_named(cluster):
    spec_dict = emulate.spec_dict(cluster)
    spec_dict["nodes"].append({"address": f"{emulate.SUBNET}.9", "launch_prefix": ["ip", "netns", "exec",
                                                                                 f"{NAME}-h9"]})
    start = time.monotonic()
    with pytest.raises(probe.ProbeError, match=rf"Node '{emulate.SUBNET}\.9': the probe server exited "
                                               rf".*{NAME}-h9"):
        probe.probe(ResourceSpec.from_dict(spec_dict), seconds=0.3, timeout=10)
    assert time.monotonic() - start < 60


@pytest.mark.multinode
@needs_root
@pytest.mark.timeout(180)
def test_an_address_nobody_has_is_named(cluster):
    # The program starts on h2, but the chief connects to an address no host of the subnet has.
    spec_dict = emulate.spec_dict(cluster)
    spec_dict["nodes"][1]["address"] = f"{emulate.SUBNET}.99"
    start = time.monotonic()
    with pytest.raises(probe.ProbeError, match=rf"Node '{emulate.SUBNET}\.99': the measurement from the chief "
                                               rf"'{cluster.hosts[0].address}' .*could not connect"):
        probe.probe(ResourceSpec.from_dict(spec_dict), seconds=0.3, timeout=3)
    assert time.monotonic() - start < 30
