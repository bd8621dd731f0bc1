"""Cluster description ("resource spec") loaded from YAML and validated up front.

The format (see configs/local_2cpu.yml and configs/example_multi_node.yml) is a
``nodes`` list, each node with an ``address``, ``cpus``/``gpus`` id lists and
optional ``chief``, ``ssh_config``, ``network_bandwidth``, ``launch_prefix`` and
``memory``, plus an optional ``ssh`` mapping of named SSH settings. Rules beyond the
per-field checks:

* A node without ``cpus`` gets ``DEFAULT_CPUS`` (``[0]``); an explicit empty
  list is an error, because the first CPU of a node hosts parameter servers.
* On a node with GPUs the GPUs are the replicas; otherwise each CPU id is one
  replica (a TensorFlow logical CPU device).
* With several nodes exactly one has ``chief: true``; a single node is always
  the chief (its ``NodeSpec.chief`` is True).
* ``memory`` is what AutoDist's processes on the node may use together (``16g``,
  ``512m``, or bytes); with it, a strategy whose variables and optimizer slots
  cannot fit on the node is refused before training.
* A key whose value is ``null`` counts as absent.

Every problem is reported at construction as one ``ResourceSpecError`` whose
message names the source, the field and the offending value.
"""

import dataclasses
import math
import os
import re
from typing import Any, Callable, NamedTuple

import yaml

DEFAULT_BANDWIDTH_GBPS = 1.0
"""Network bandwidth (Gbit/s) assumed for a node without ``network_bandwidth``."""

DEFAULT_CPUS = (0,)
"""CPU ids assumed for a node without ``cpus``."""

DEFAULT_SSH_PORT = 22

_DEVICE_TYPES = ("CPU", "GPU")

_MEMORY_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(?:i?b)?\s*")
MIN_MEMORY_BYTES = 64 * 2 ** 20
"""The least memory a node or an emulated host may be given: a TensorFlow process needs more."""
_MIN_MEMORY = f"{MIN_MEMORY_BYTES // 2 ** 20}m"


class ResourceSpecError(ValueError):
    """Raised when a resource spec, or a device string, is invalid."""


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One device of the cluster, e.g. ``localhost:GPU:1``."""

    host_address: str
    device_type: str
    device_index: int

    def __post_init__(self):
        if self.device_type not in _DEVICE_TYPES or not _is_int(self.device_index) or self.device_index < 0:
            raise ResourceSpecError(
                f"DeviceSpec({self.host_address!r}, {self.device_type!r}, {self.device_index!r}) is invalid; "
                f"device_type must be one of {list(_DEVICE_TYPES)} and device_index a non-negative integer.")

    def name_string(self) -> str:
        """Returns the device as ``"<address>:<CPU|GPU>:<index>"``."""
        return f"{self.host_address}:{self.device_type}:{self.device_index}"

    @classmethod
    def from_string(cls, s: str) -> "DeviceSpec":
        """Parses the output of ``name_string``.

        Args:
            s: A string such as ``"10.0.0.1:GPU:0"``. The address may itself
                contain colons (IPv6); the last two fields are type and index.

        Returns:
            DeviceSpec: The parsed device.

        Raises:
            ResourceSpecError: If ``s`` is not of that form.
        """
        parts = s.rsplit(":", 2) if isinstance(s, str) else []
        index_ok = len(parts) == 3 and parts[2].isascii() and parts[2].isdigit()
        if not index_ok or not parts[0] or parts[1] not in _DEVICE_TYPES:
            raise ResourceSpecError(
                f"Device string {s!r} is malformed; expected '<address>:<CPU|GPU>:<index>', "
                f"for example 'localhost:CPU:0'.")
        return cls(parts[0], parts[1], int(parts[2]))


@dataclasses.dataclass(frozen=True)
class SSHConfig:
    """How to reach a node over SSH (one entry under the top-level ``ssh:``)."""

    username: str
    port: int = DEFAULT_SSH_PORT
    key_file: str | None = None
    python_venv: str | None = None
    # Excluded from hashing because dicts are unhashable; still compared.
    shared_envs: dict[str, str] = dataclasses.field(default_factory=dict, hash=False)


@dataclasses.dataclass(frozen=True)
class NodeSpec:
    """One node of the cluster; the defaults are those of an omitted YAML field."""

    address: str
    cpus: tuple[int, ...] = DEFAULT_CPUS
    gpus: tuple[int, ...] = ()
    chief: bool = False
    ssh_config: str | None = None
    network_bandwidth: float | None = None
    launch_prefix: tuple[str, ...] | None = None
    memory: int | None = None  # bytes


def parse_memory(size: str | int) -> int:
    """Converts a memory size such as ``"3g"``, ``"512m"`` or ``"1.5gb"`` to bytes.

    Units are binary, as cgroups and container tools read them: ``k``, ``m``,
    ``g``, ``t`` (optionally followed by ``b``, or ``i``/``ib``) are powers of
    1024. A plain integer is bytes.

    Raises:
        ValueError: If ``size`` is not a size of at least 64 MiB.
    """
    if isinstance(size, int) and not isinstance(size, bool):
        count = size
    else:
        m = _MEMORY_RE.fullmatch(size.lower()) if isinstance(size, str) else None
        if m is None:
            raise ValueError(f"Memory {size!r} is not a size; write a number and a unit, e.g. '3g', "
                             "'512m' or '1.5g' (units k, m, g, t: powers of 1024).")
        count = int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2) or " "))
    if count < MIN_MEMORY_BYTES:
        raise ValueError(f"Memory {size!r} is below {_MIN_MEMORY}; a TensorFlow process needs "
                         "more than that.")
    return count


def _is_memory(v: Any) -> bool:
    try:
        parse_memory(v)
    except ValueError:
        return False
    return True


class _Loc(NamedTuple):
    """Where a value sits in the spec (source and e.g. "node 2 ('h2')"); builds its errors."""

    source: str
    owner: str

    def error(self, text: str) -> ResourceSpecError:
        return _error(self.source, f"{self.owner} {text}")


_MAX_MESSAGE = 1500  # characters of an error message; a spec's values may be huge


def _error(source: str, text: str) -> ResourceSpecError:
    message = f"Resource spec {source!r}: {text}"
    if len(message) > _MAX_MESSAGE:
        message = f"{message[:_MAX_MESSAGE - 300]} ... {message[-250:]}"
    return ResourceSpecError(message)


class _StrictLoader(yaml.SafeLoader):
    """Safe YAML without aliases or duplicate keys.

    An alias repeats a subtree by reference, so a few hundred bytes can expand to
    gigabytes; a duplicate key silently keeps its last value. A spec needs neither.
    """

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise yaml.composer.ComposerError(
                None, None, "aliases (*name) are not allowed in a resource spec; write the "
                "values out", mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} appears twice in one mapping; keep one",
                    key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_str(v: Any) -> bool:
    return isinstance(v, str) and bool(v.strip())


MAX_DEVICE_ID = 1023  # TensorFlow makes max(id) + 1 logical devices on the node


def _is_ids(v: Any) -> bool:
    return (isinstance(v, list) and all(_is_int(i) and 0 <= i <= MAX_DEVICE_ID for i in v)
            and len(set(v)) == len(v))


def _is_env(v: Any) -> bool:
    return isinstance(v, dict) and all(
        _is_str(k) and (isinstance(x, (str, float)) or _is_int(x)) for k, x in v.items())


class _Field(NamedTuple):
    """One row of a field table: a predicate, what it demands, an example and the normaliser.

    Defaults for omitted fields are those of the ``NodeSpec``/``SSHConfig`` dataclasses.
    """

    ok: Callable[[Any], bool]
    demand: str
    example: str
    convert: Callable[[Any], Any]
    required: bool = False

_NODE_FIELDS = {
    "address": _Field(_is_str, "a non-empty string", "address: 10.0.0.1", str, True),
    "cpus": _Field(lambda v: _is_ids(v) and bool(v), "a non-empty list of distinct integer ids "
                   f"from 0 to {MAX_DEVICE_ID} (omit it to get the default [0])", "cpus: [0, 1]",
                   tuple),
    "gpus": _Field(_is_ids, f"a list of distinct integer ids from 0 to {MAX_DEVICE_ID}",
                   "gpus: [0, 1]", tuple),
    "chief": _Field(lambda v: isinstance(v, bool), "a boolean", "chief: true", bool),
    "ssh_config": _Field(_is_str, "the name of an entry under 'ssh'", "ssh_config: conf1", str),
    "network_bandwidth": _Field(
        lambda v: (_is_int(v) or isinstance(v, float)) and math.isfinite(v) and v > 0,
        "a positive number of Gbit/s", "network_bandwidth: 10", float),
    "launch_prefix": _Field(lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
                            "a list of strings", "launch_prefix: [ip, netns, exec, h2]", tuple),
    "memory": _Field(_is_memory, f"a size of at least {_MIN_MEMORY}: a number and a unit k, m, "
                     "g or t (powers of 1024), or bytes", "memory: 16g", parse_memory),
}
_SSH_FIELDS = {
    "username": _Field(_is_str, "a non-empty string", "username: root", str, True),
    "port": _Field(lambda v: _is_int(v) and 1 <= v <= 65535, "an integer between 1 and 65535",
                   f"port: {DEFAULT_SSH_PORT}", int),
    "key_file": _Field(_is_str, "a non-empty path string", "key_file: ~/.ssh/id_rsa", str),
    "python_venv": _Field(_is_str, "a non-empty shell command string",
                          "python_venv: 'source /venv/bin/activate'", str),
    "shared_envs": _Field(_is_env, "a mapping from variable names to string or number values",
                          "shared_envs: {LD_LIBRARY_PATH: /usr/local/lib}",
                          lambda v: {k: str(x) for k, x in v.items()}),
}


def _parse_fields(raw: Any, loc: _Loc, table: dict[str, _Field], what: str) -> dict[str, Any]:
    """Checks one mapping against a field table; returns the normalised values of the fields set."""
    if not isinstance(raw, dict):
        raise loc.error(f"is {raw!r}, but it must be a mapping. Write the {what} as 'key: value' pairs.")
    unknown = sorted(str(k) for k in raw if k not in table)
    if unknown:
        raise loc.error(f"has unknown field(s) {unknown}. Valid {what} fields are {list(table)}.")
    out = {}
    for key, f in table.items():
        value = raw.get(key)
        if value is None:
            if f.required:
                raise loc.error(f"is missing the required field '{key}'. Add it, e.g. '{f.example}'.")
        elif not f.ok(value):
            raise loc.error(f"field '{key}' is {value!r}, but it must be {f.demand}. "
                            f"Fix it, e.g. '{f.example}'.")
        else:
            out[key] = f.convert(value)
    return out


class ResourceSpec:
    """A validated, immutable cluster description.

    Args:
        resource_file: Path of the YAML resource spec.

    Raises:
        ResourceSpecError: If the file is missing, unreadable, not valid YAML
            or breaks any rule listed in the module docstring.
    """

    def __init__(self, resource_file: str):
        path = os.fspath(resource_file)
        if not os.path.isfile(path):
            raise _error(path, "the file does not exist or is not a regular file. Check the path, "
                               "or start from configs/local_2cpu.yml.")
        try:
            with open(path, encoding="utf-8") as f:
                spec = yaml.load(f, Loader=_StrictLoader)  # noqa: S506 - a safe loader
        except (OSError, UnicodeDecodeError) as e:
            raise _error(path, f"the file could not be read ({e}). Check its permissions and that it "
                               "is UTF-8 text.") from e
        except yaml.YAMLError as e:
            raise _error(path, f"the file is not valid YAML ({e}). Fix the syntax at the position "
                               "shown.") from e
        self._init(spec, path)

    @classmethod
    def from_dict(cls, spec: dict, source: str = "<dict>") -> "ResourceSpec":
        """Builds a spec from an already-parsed mapping, with the same rules as a file.

        Args:
            spec: Mapping with the layout of the YAML file.
            source: Name used in error messages and as ``source``.

        Returns:
            ResourceSpec: The validated spec.

        Raises:
            ResourceSpecError: If ``spec`` is invalid.
        """
        self = cls.__new__(cls)
        self._init(spec, source)
        return self

    def _init(self, spec: Any, source: str) -> None:
        self._source = source
        loc = _Loc(source, "the top level")
        if not isinstance(spec, dict):
            raise loc.error(f"is {spec!r}, but it must be a mapping with a 'nodes' list and optionally "
                            "'ssh'. Start from configs/local_2cpu.yml.")
        unknown = sorted(str(k) for k in spec if k not in ("nodes", "ssh"))
        if unknown:
            raise loc.error(f"has unknown field(s) {unknown}. Valid top-level fields are ['nodes', 'ssh'].")
        ssh = {} if spec.get("ssh") is None else spec["ssh"]
        if not isinstance(ssh, dict):
            raise _error(source, f"top-level field 'ssh' is {ssh!r}, but it must map config names to "
                                 "SSH settings. Write e.g. 'ssh: {conf1: {username: root}}'.")
        self._ssh_configs = {
            str(name): SSHConfig(**_parse_fields(entry, _Loc(source, f"ssh entry {name!r}"),
                                                 _SSH_FIELDS, "ssh entry"))
            for name, entry in ssh.items()}
        self._nodes = self._parse_nodes(spec.get("nodes"), source)

    def _parse_nodes(self, raw: Any, source: str) -> tuple[NodeSpec, ...]:
        if not isinstance(raw, list) or not raw:
            raise _error(source, f"top-level field 'nodes' is {raw!r}, but it must be a non-empty list "
                                 "of nodes. Write e.g. 'nodes: [{address: localhost, cpus: [0]}]'.")
        nodes: list[NodeSpec] = []
        for i, entry in enumerate(raw, start=1):
            addr = entry.get("address") if isinstance(entry, dict) else None
            loc = _Loc(source, f"node {i}" + (f" ({addr!r})" if _is_str(addr) else ""))
            node = NodeSpec(**_parse_fields(entry, loc, _NODE_FIELDS, "node"))
            if node.address in (n.address for n in nodes):
                raise loc.error(f"field 'address' is {node.address!r}, but an earlier node already uses "
                                "it. Give every node a distinct address.")
            if node.ssh_config is not None and node.ssh_config not in self._ssh_configs:
                raise loc.error(f"field 'ssh_config' is {node.ssh_config!r}, but no such entry exists "
                                f"under 'ssh' (defined: {sorted(self._ssh_configs)}). Use a defined "
                                "entry or add this one.")
            nodes.append(node)
        chiefs = [n.address for n in nodes if n.chief]
        if len(nodes) == 1:
            nodes[0] = dataclasses.replace(nodes[0], chief=True)
        elif len(chiefs) != 1:
            raise _error(source, f"field 'chief' is true on {len(chiefs)} of {len(nodes)} nodes {chiefs}, "
                                 "but a multi-node spec needs exactly one chief. Set 'chief: true' on "
                                 "exactly one node.")
        return tuple(nodes)

    @property
    def source(self) -> str:
        """str: The file path, or the name given to ``from_dict``."""
        return self._source

    @property
    def nodes(self) -> tuple[NodeSpec, ...]:
        """tuple[NodeSpec, ...]: The nodes in file order."""
        return self._nodes

    @property
    def chief(self) -> str:
        """str: Address of the chief node."""
        return next(n.address for n in self._nodes if n.chief)

    @property
    def ssh_configs(self) -> dict[str, SSHConfig]:
        """dict[str, SSHConfig]: SSH entries by name (a copy)."""
        return dict(self._ssh_configs)

    @property
    def node_addresses(self) -> list[str]:
        """list[str]: Node addresses in file order."""
        return [n.address for n in self._nodes]

    @property
    def replica_devices(self) -> list[DeviceSpec]:
        """list[DeviceSpec]: Per node in file order, its GPUs if any, else its CPUs."""
        return [d for n in self._nodes for d in self.node_replicas(n.address)]

    @property
    def cpu_devices(self) -> list[DeviceSpec]:
        """list[DeviceSpec]: Every CPU of every node, in file order."""
        return [DeviceSpec(n.address, "CPU", i) for n in self._nodes for i in n.cpus]

    @property
    def ps_devices(self) -> list[DeviceSpec]:
        """list[DeviceSpec]: The first CPU of every node, chief first, then file order."""
        ordered = sorted(self._nodes, key=lambda n: not n.chief)  # stable sort keeps file order
        return [DeviceSpec(n.address, "CPU", n.cpus[0]) for n in ordered]

    @property
    def num_replicas(self) -> int:
        """int: Total number of replica devices."""
        return len(self.replica_devices)

    @property
    def network_bandwidth(self) -> dict[str, float]:
        """dict[str, float]: Gbit/s per address (``DEFAULT_BANDWIDTH_GBPS`` if unset)."""
        return {n.address: DEFAULT_BANDWIDTH_GBPS if n.network_bandwidth is None else n.network_bandwidth
                for n in self._nodes}

    def node(self, address: str) -> NodeSpec:
        """Returns the node with ``address``.

        Raises:
            ResourceSpecError: If no node has that address.
        """
        for n in self._nodes:
            if n.address == address:
                return n
        raise _error(self._source, f"there is no node with address {address!r}. "
                                   f"Use one of {self.node_addresses}.")

    def node_replicas(self, address: str) -> list[DeviceSpec]:
        """Returns the replica devices of one node (GPUs if any, else CPUs).

        Raises:
            ResourceSpecError: If no node has that address.
        """
        n = self.node(address)
        kind, ids = ("GPU", n.gpus) if n.gpus else ("CPU", n.cpus)
        return [DeviceSpec(n.address, kind, i) for i in ids]

    def to_dict(self) -> dict:
        """Returns a plain mapping that ``from_dict`` turns back into an equal spec.

        Returns:
            dict: ``{"nodes": [...], "ssh": {...}}`` with unset optional fields omitted.
        """
        def plain(obj):
            return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(obj).items()
                    if v is not None and v != {} and not (k == "gpus" and not v)}
        return {"nodes": [plain(n) for n in self._nodes],
                "ssh": {k: plain(v) for k, v in self._ssh_configs.items()}}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ResourceSpec):
            return NotImplemented
        return self._nodes == other._nodes and self._ssh_configs == other._ssh_configs

    def __repr__(self) -> str:
        return f"ResourceSpec(source={self._source!r}, nodes={self.node_addresses}, chief={self.chief!r})"
