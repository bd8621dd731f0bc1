"""Tests for autodist.resource_spec: validation messages, device lists, round trips."""

import copy
import pathlib

import pytest
import yaml

from autodist.resource_spec import (DEFAULT_BANDWIDTH_GBPS, DeviceSpec, NodeSpec, ResourceSpec,
                                    ResourceSpecError, SSHConfig, parse_memory)

pytestmark = pytest.mark.timeout(60)

CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"

TWO_NODES = {
    "nodes": [
        {"address": "10.0.0.1", "cpus": [0], "gpus": [0, 1], "chief": True, "network_bandwidth": 25},
        {"address": "10.0.0.2", "cpus": [3, 4], "ssh_config": "conf1",
         "launch_prefix": ["ip", "netns", "exec", "h2"]},
    ],
    "ssh": {"conf1": {"username": "root", "key_file": "/root/.ssh/id_rsa", "port": 2222,
                      "python_venv": "source /venv/bin/activate",
                      "shared_envs": {"LD_LIBRARY_PATH": "/usr/lib", "OMP_NUM_THREADS": 4}}},
}


def _write(tmp_path, content, name="spec.yml"):
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else yaml.safe_dump(content))
    return str(path)


def _with(node_changes=None, index=1, **top):
    """TWO_NODES with node `index` updated (a value of ... deletes the key) and top-level overrides."""
    spec = copy.deepcopy(TWO_NODES)
    for key, value in (node_changes or {}).items():
        if value is ...:
            spec["nodes"][index].pop(key, None)
        else:
            spec["nodes"][index][key] = value
    spec.update(top)
    return spec


def _error_for(tmp_path, content):
    path = _write(tmp_path, content)
    with pytest.raises(ResourceSpecError) as info:
        ResourceSpec(path)
    message = str(info.value)
    assert path in message, message  # every message names the source file
    assert message.rstrip().endswith("."), message  # and is a complete sentence
    return message


# (id, spec content, substrings the message must contain: field and offending value)
BAD_SPECS = [
    ("invalid_yaml", "nodes: [address: a\n  - : :", ["not valid YAML"]),
    ("empty_file", "", ["top level", "None", "mapping"]),
    ("top_not_mapping", "- a\n- b\n", ["top level", "['a', 'b']", "mapping"]),
    ("unknown_top_key", _with(cluster=1), ["unknown field", "'cluster'", "['nodes', 'ssh']"]),
    ("missing_nodes", {"ssh": {}}, ["'nodes'", "None"]),
    ("empty_nodes", {"nodes": []}, ["'nodes'", "[]", "non-empty list"]),
    ("nodes_not_list", {"nodes": {"address": "a"}}, ["'nodes'", "{'address': 'a'}"]),
    ("node_not_mapping", {"nodes": ["localhost"]}, ["node 1", "'localhost'", "mapping"]),
    ("missing_address", {"nodes": [{"cpus": [0]}]}, ["node 1", "'address'", "missing"]),
    ("empty_address", {"nodes": [{"address": "  "}]}, ["'address'", "'  '", "non-empty string"]),
    ("address_not_str", {"nodes": [{"address": 17}]}, ["'address'", "17", "non-empty string"]),
    ("duplicate_address", _with({"address": "10.0.0.1"}), ["node 2", "'address'", "'10.0.0.1'", "distinct"]),
    ("cpus_not_list", _with({"cpus": 0}), ["node 2 ('10.0.0.2')", "'cpus'", "is 0"]),
    ("cpus_non_int", _with({"cpus": [0, "1"]}), ["'cpus'", "[0, '1']"]),
    ("cpus_bool", _with({"cpus": [True]}), ["'cpus'", "[True]"]),
    ("cpus_negative", _with({"cpus": [-1]}), ["'cpus'", "[-1]", "from 0 to 1023"]),
    ("cpus_duplicate", _with({"cpus": [2, 2]}), ["'cpus'", "[2, 2]", "distinct"]),
    ("cpus_empty", _with({"cpus": []}), ["'cpus'", "[]", "non-empty", "[0]"]),
    ("gpus_not_list", _with({"gpus": "0,1"}, index=0), ["node 1", "'gpus'", "'0,1'"]),
    ("gpus_duplicate", _with({"gpus": [1, 1]}, index=0), ["'gpus'", "[1, 1]"]),
    ("gpus_float", _with({"gpus": [0.5]}, index=0), ["'gpus'", "[0.5]"]),
    ("no_chief", _with({"chief": ...}, index=0), ["'chief'", "0 of 2", "exactly one"]),
    ("two_chiefs", _with({"chief": True}), ["'chief'", "['10.0.0.1', '10.0.0.2']", "exactly one"]),
    ("chief_not_bool", _with({"chief": "yes"}), ["'chief'", "'yes'", "boolean"]),
    ("undefined_ssh_config", _with({"ssh_config": "conf2"}), ["'ssh_config'", "'conf2'", "['conf1']"]),
    ("ssh_config_without_ssh", _with(ssh=None), ["'ssh_config'", "'conf1'", "[]"]),
    ("bandwidth_string", _with({"network_bandwidth": "fast"}), ["'network_bandwidth'", "'fast'", "positive"]),
    ("bandwidth_zero", _with({"network_bandwidth": 0}), ["'network_bandwidth'", "is 0,"]),
    ("bandwidth_negative", _with({"network_bandwidth": -2.5}), ["'network_bandwidth'", "-2.5"]),
    ("bandwidth_bool", _with({"network_bandwidth": True}), ["'network_bandwidth'", "True"]),
    ("bandwidth_inf", "nodes:\n  - {address: a, network_bandwidth: .inf}\n", ["'network_bandwidth'", "inf"]),
    ("launch_prefix_string", _with({"launch_prefix": "ip netns"}), ["'launch_prefix'", "'ip netns'"]),
    ("launch_prefix_ints", _with({"launch_prefix": ["ip", 3]}), ["'launch_prefix'", "['ip', 3]"]),
    ("memory_words", _with({"memory": "lots"}), ["node 2", "'memory'", "'lots'", "memory: 16g"]),
    ("memory_tiny", _with({"memory": "10m"}), ["'memory'", "'10m'", "at least 64m"]),
    ("memory_bool", _with({"memory": True}), ["'memory'", "True"]),
    ("unknown_node_key", _with({"gpu": [0], "hostname": "x"}),
     ["node 2", "['gpu', 'hostname']", "'address'", "'launch_prefix'"]),
    ("ssh_not_mapping", _with(ssh=["conf1"]), ["'ssh'", "['conf1']"]),
    ("ssh_entry_not_mapping", _with(ssh={"conf1": "root"}), ["ssh entry 'conf1'", "'root'", "mapping"]),
    ("ssh_missing_username", _with(ssh={"conf1": {"port": 22}}), ["ssh entry 'conf1'", "'username'", "missing"]),
    ("ssh_bad_port", _with(ssh={"conf1": {"username": "u", "port": "22"}}), ["'port'", "'22'", "65535"]),
    ("ssh_port_range", _with(ssh={"conf1": {"username": "u", "port": 70000}}), ["'port'", "70000"]),
    ("ssh_unknown_key", _with(ssh={"conf1": {"username": "u", "user": "v"}}), ["['user']", "'username'"]),
    ("ssh_bad_envs", _with(ssh={"conf1": {"username": "u", "shared_envs": ["A=1"]}}),
     ["'shared_envs'", "['A=1']"]),
]


@pytest.mark.parametrize("content, expected", [c[1:] for c in BAD_SPECS], ids=[c[0] for c in BAD_SPECS])
def test_invalid_spec_message_names_field_and_value(tmp_path, content, expected):
    message = _error_for(tmp_path, content)
    for fragment in expected:
        assert fragment in message, f"{fragment!r} not in: {message}"


def test_missing_file(tmp_path):
    path = str(tmp_path / "nope.yml")
    with pytest.raises(ResourceSpecError, match="does not exist") as info:
        ResourceSpec(path)
    assert path in str(info.value)


def test_directory_is_not_a_file(tmp_path):
    with pytest.raises(ResourceSpecError, match="not a regular file"):
        ResourceSpec(str(tmp_path))


def test_yaml_error_is_chained(tmp_path):
    with pytest.raises(ResourceSpecError) as info:
        ResourceSpec(_write(tmp_path, "nodes: [\n"))
    assert isinstance(info.value.__cause__, yaml.YAMLError)


def test_error_is_a_value_error():
    with pytest.raises(ValueError):
        ResourceSpec.from_dict({"nodes": []})


def test_from_dict_names_its_source():
    with pytest.raises(ResourceSpecError, match="'my-cluster'"):
        ResourceSpec.from_dict({"nodes": 3}, source="my-cluster")


def test_single_cpu_node_defaults(tmp_path):
    spec = ResourceSpec(_write(tmp_path, "nodes:\n  - address: localhost\n"))
    node = spec.node("localhost")
    assert node == NodeSpec("localhost", (0,), (), True, None, None, None)
    assert spec.chief == "localhost"
    assert spec.replica_devices == [DeviceSpec("localhost", "CPU", 0)]
    assert spec.ps_devices == [DeviceSpec("localhost", "CPU", 0)]
    assert spec.network_bandwidth == {"localhost": DEFAULT_BANDWIDTH_GBPS}
    assert spec.ssh_configs == {}
    assert spec.num_replicas == 1


def test_null_values_count_as_absent():
    spec = ResourceSpec.from_dict({"nodes": [{"address": "a", "cpus": None, "gpus": None, "chief": None}],
                                   "ssh": None})
    assert spec.node("a").cpus == (0,) and spec.node("a").gpus == ()


def test_two_node_spec(tmp_path):
    spec = ResourceSpec(_write(tmp_path, TWO_NODES))
    assert spec.source == str(tmp_path / "spec.yml")
    assert spec.node_addresses == ["10.0.0.1", "10.0.0.2"]
    assert [n.address for n in spec.nodes] == spec.node_addresses
    assert spec.chief == "10.0.0.1"
    assert [d.name_string() for d in spec.replica_devices] == [
        "10.0.0.1:GPU:0", "10.0.0.1:GPU:1", "10.0.0.2:CPU:3", "10.0.0.2:CPU:4"]
    assert spec.num_replicas == 4
    assert [d.name_string() for d in spec.cpu_devices] == ["10.0.0.1:CPU:0", "10.0.0.2:CPU:3", "10.0.0.2:CPU:4"]
    assert [d.name_string() for d in spec.ps_devices] == ["10.0.0.1:CPU:0", "10.0.0.2:CPU:3"]
    assert spec.node_replicas("10.0.0.2") == [DeviceSpec("10.0.0.2", "CPU", 3), DeviceSpec("10.0.0.2", "CPU", 4)]
    assert spec.network_bandwidth == {"10.0.0.1": 25.0, "10.0.0.2": DEFAULT_BANDWIDTH_GBPS}
    worker = spec.node("10.0.0.2")
    assert worker.ssh_config == "conf1" and not worker.chief
    assert worker.launch_prefix == ("ip", "netns", "exec", "h2")
    assert spec.ssh_configs == {"conf1": SSHConfig(
        "root", 2222, "/root/.ssh/id_rsa", "source /venv/bin/activate",
        {"LD_LIBRARY_PATH": "/usr/lib", "OMP_NUM_THREADS": "4"})}


def test_ps_devices_put_chief_first():
    spec = ResourceSpec.from_dict({"nodes": [{"address": "w1", "cpus": [1]}, {"address": "c", "chief": True},
                                             {"address": "w2"}]})
    assert [d.name_string() for d in spec.ps_devices] == ["c:CPU:0", "w1:CPU:1", "w2:CPU:0"]
    assert spec.chief == "c"


def test_unknown_node_lookup():
    spec = ResourceSpec.from_dict({"nodes": [{"address": "a"}]})
    with pytest.raises(ResourceSpecError, match=r"'b'.*\['a'\]"):
        spec.node("b")
    with pytest.raises(ResourceSpecError, match="'b'"):
        spec.node_replicas("b")


def test_spec_is_not_mutated_through_properties():
    spec = ResourceSpec.from_dict(TWO_NODES)
    spec.ssh_configs.clear()
    spec.node_addresses.append("x")
    assert "conf1" in spec.ssh_configs and spec.node_addresses == ["10.0.0.1", "10.0.0.2"]
    with pytest.raises(AttributeError):
        spec.nodes[0].address = "other"


@pytest.mark.parametrize("name", ["localhost:CPU:0", "10.0.0.1:GPU:7", "fe80::1:GPU:2", "my-host.example:CPU:12"])
def test_device_string_round_trip(name):
    device = DeviceSpec.from_string(name)
    assert device.name_string() == name
    assert DeviceSpec.from_string(device.name_string()) == device


def test_device_from_string_fields():
    assert DeviceSpec.from_string("h:GPU:3") == DeviceSpec(host_address="h", device_type="GPU", device_index=3)


@pytest.mark.parametrize("bad", ["", "localhost", "localhost:CPU", ":CPU:0", "h:TPU:0", "h:cpu:0",
                                 "h:CPU:-1", "h:CPU:x", "h:CPU:", "h:CPU:²"])
def test_device_from_string_rejects_malformed(bad):
    with pytest.raises(ResourceSpecError, match="malformed") as info:
        DeviceSpec.from_string(bad)
    assert repr(bad) in str(info.value)


def test_device_spec_rejects_bad_fields():
    with pytest.raises(ResourceSpecError, match="device_type"):
        DeviceSpec("h", "TPU", 0)
    with pytest.raises(ResourceSpecError, match="device_index"):
        DeviceSpec("h", "CPU", -1)


@pytest.mark.parametrize("source", [TWO_NODES, {"nodes": [{"address": "solo", "gpus": [0]}]},
                                    {"nodes": [{"address": "a", "launch_prefix": []}]},
                                    {"nodes": [{"address": "a", "memory": "1.5g"}]}])
def test_to_dict_round_trip(source):
    spec = ResourceSpec.from_dict(source)
    as_dict = spec.to_dict()
    again = ResourceSpec.from_dict(as_dict)
    assert again == spec
    assert again.nodes == spec.nodes and again.ssh_configs == spec.ssh_configs
    assert again.to_dict() == as_dict
    # The dict is plain YAML-serialisable data, so it also round-trips through a file.
    assert ResourceSpec.from_dict(yaml.safe_load(yaml.safe_dump(as_dict))) == spec


def test_local_2cpu_config():
    spec = ResourceSpec(str(CONFIGS / "local_2cpu.yml"))
    assert spec.chief == "localhost"
    assert [d.name_string() for d in spec.replica_devices] == ["localhost:CPU:0", "localhost:CPU:1"]
    assert [d.name_string() for d in spec.ps_devices] == ["localhost:CPU:0"]


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    spec = ResourceSpec(str(path))
    assert spec.num_replicas >= 1
    assert spec.chief in spec.node_addresses


def test_example_multi_node_config():
    spec = ResourceSpec(str(CONFIGS / "example_multi_node.yml"))
    assert len(spec.nodes) == 2
    workers = [n for n in spec.nodes if not n.chief]
    assert all(n.ssh_config in spec.ssh_configs for n in workers)


# --- Bounded input: what a few bytes of YAML must not be able to do ------------------------------

def test_an_alias_bomb_is_refused_at_once_with_a_short_message(tmp_path):
    import time
    levels = ["a: &a [" + ", ".join(['"xxxxxxxxxx"'] * 9) + "]"]
    for level in "bcdefgh":
        previous = chr(ord(level) - 1)
        levels.append(f"{level}: &{level} [" + ", ".join([f"*{previous}"] * 9) + "]")
    bomb = "\n".join(levels) + "\nnodes: [{address: localhost, cpus: *h}]\n"
    assert len(bomb) < 1000
    start = time.monotonic()
    message = _error_for(tmp_path, bomb)
    assert time.monotonic() - start < 1.0
    assert len(message) < 2048
    assert "aliases (*name) are not allowed" in message and "line 2" in message


def test_a_duplicate_key_is_refused(tmp_path):
    message = _error_for(tmp_path, "nodes:\n  - address: localhost\n    cpus: [0]\n    cpus: [0, 1]\n")
    assert "the key 'cpus' appears twice" in message and "line 4" in message


@pytest.mark.parametrize("ids", [[0, 99999999], [0, 10 ** 23], [1024]])
def test_device_ids_beyond_a_sane_bound_are_refused(tmp_path, ids):
    message = _error_for(tmp_path, {"nodes": [{"address": "localhost", "cpus": ids}]})
    assert "field 'cpus'" in message and "from 0 to 1023" in message


def test_a_huge_value_is_shown_truncated(tmp_path):
    message = _error_for(tmp_path, {"nodes": [{"address": "localhost", "cpus": "x" * 100_000}]})
    assert len(message) <= 1500 and " ... " in message and "field 'cpus'" in message


@pytest.mark.parametrize("text, count", [
    ("3g", 3 * 2 ** 30), ("512m", 512 * 2 ** 20), ("1.5G", int(1.5 * 2 ** 30)), ("2gb", 2 * 2 ** 30),
    ("1gib", 2 ** 30), (" 100m ", 100 * 2 ** 20), (2 ** 30, 2 ** 30)])
def test_parse_memory(text, count):
    assert parse_memory(text) == count


@pytest.mark.parametrize("bad", ["", "g", "3 gigabytes", "-1g", "10m", 1000, None, True, "1e3m"])
def test_parse_memory_rejects(bad):
    with pytest.raises(ValueError, match="Memory"):
        parse_memory(bad)


def test_memory_is_read_in_bytes():
    spec = ResourceSpec.from_dict({"nodes": [{"address": "a", "memory": "3g"},
                                             {"address": "b", "memory": 2 ** 30, "chief": True},
                                             {"address": "c"}]})
    assert [n.memory for n in spec.nodes] == [3 * 2 ** 30, 2 ** 30, None]
