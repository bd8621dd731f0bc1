"""Strategy: a thin wrapper around ``strategy_pb2.Strategy``, plus the builder interface."""
from __future__ import annotations

import abc
import datetime
import os
import secrets
import tempfile
from typing import Any, Dict, List, Optional, Union

from google.protobuf import message as pb_message
from google.protobuf import text_format

from autodist.proto import strategy_pb2

PathLike = Union[str, "os.PathLike[str]"]


class StrategyError(ValueError):
    """A strategy is malformed, or cannot be stored or loaded."""


def new_strategy_id() -> str:
    """Makes a fresh strategy id.

    The id is a UTC timestamp (sortable, useful as a file name) followed by a
    short random suffix so that strategies built in the same microsecond on
    different processes still differ.

    Returns:
        str: e.g. ``"20250101T120000123456-3fa2c1"``.
    """
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S%f")
    return f"{stamp}-{secrets.token_hex(3)}"


def _unknown_field_count(proto: pb_message.Message) -> int:
    """Counts top-level unknown fields, or 0 when the runtime cannot tell."""
    try:
        from google.protobuf import unknown_fields
    except ImportError:  # older protobuf runtimes
        return 0
    return len(unknown_fields.UnknownFieldSet(proto))


class Strategy:
    """A distribution strategy: per-variable partitioning, placement and synchronization.

    The wrapper owns its proto: the constructor copies the given message, so
    later changes to the caller's message do not leak in (and vice versa).

    Args:
        proto: an existing ``strategy_pb2.Strategy``; an empty one when None.
            A fresh unique id is assigned when its ``id`` is empty.

    Raises:
        TypeError: if ``proto`` is not a ``strategy_pb2.Strategy``.
    """

    def __init__(self, proto: Optional[strategy_pb2.Strategy] = None):
        if proto is not None and not isinstance(proto, strategy_pb2.Strategy):
            raise TypeError(
                f"Strategy(proto=...) expects a strategy_pb2.Strategy, got {type(proto).__name__}.")
        self._proto = strategy_pb2.Strategy()
        if proto is not None:
            self._proto.CopyFrom(proto)
        if not self._proto.id:
            self._proto.id = new_strategy_id()

    @property
    def proto(self) -> strategy_pb2.Strategy:
        """strategy_pb2.Strategy: the underlying message (mutable, owned by this object)."""
        return self._proto

    @property
    def id(self) -> str:
        """str: the unique strategy id."""
        return self._proto.id

    @property
    def replicas(self) -> List[str]:
        """list[str]: replica device strings, e.g. ``["localhost:CPU:0"]``."""
        return list(self._proto.graph_config.replicas)

    @property
    def node_config(self) -> Any:
        """The repeated ``Strategy.Node`` field, one entry per trainable variable."""
        return self._proto.node_config

    def node_config_by_name(self) -> Dict[str, strategy_pb2.Strategy.Node]:
        """Indexes the top-level node configs by variable name.

        Returns:
            dict[str, strategy_pb2.Strategy.Node]: ``var_name`` -> node config.

        Raises:
            StrategyError: if two node configs share a ``var_name``.
        """
        by_name: Dict[str, strategy_pb2.Strategy.Node] = {}
        for node in self._proto.node_config:
            if node.var_name in by_name:
                raise StrategyError(
                    f"Strategy {self.id!r} has more than one node_config with "
                    f"var_name={node.var_name!r}; each variable needs exactly one.")
            by_name[node.var_name] = node
        return by_name

    def save(self, path: PathLike) -> str:
        """Writes the binary proto to ``path`` atomically.

        Parent directories are created. The data goes to a temporary file in
        the same directory first and is then renamed over ``path``, so readers
        never see a half-written file.

        Args:
            path: destination file.

        Returns:
            str: the path written.

        Raises:
            StrategyError: if the file cannot be written.
        """
        path = os.fspath(path)
        directory = os.path.dirname(os.path.abspath(path))
        tmp_name = None
        try:
            os.makedirs(directory, exist_ok=True)
            with tempfile.NamedTemporaryFile(
                    dir=directory, prefix=".strategy-", suffix=".tmp", delete=False) as tmp:
                tmp_name = tmp.name
                tmp.write(self._proto.SerializeToString())
                tmp.flush()
                os.fsync(tmp.fileno())
            os.replace(tmp_name, path)
        except OSError as err:
            if tmp_name is not None and os.path.exists(tmp_name):
                os.unlink(tmp_name)
            raise StrategyError(f"Cannot save strategy {self.id!r} to path={path!r}: {err}") from err
        return path

    @classmethod
    def load(cls, path: PathLike) -> "Strategy":
        """Reads a strategy written by :meth:`save`.

        Args:
            path: file to read.

        Returns:
            Strategy: the loaded strategy (its id is kept).

        Raises:
            StrategyError: if the file is missing or unreadable, is not a valid
                binary ``Strategy`` message, or parses but has no id or neither
                a graph_config nor any node_config (e.g. an empty file).
        """
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise StrategyError(f"Strategy file not found: path={path!r}.")
        try:
            with open(path, "rb") as handle:
                data = handle.read()
        except OSError as err:
            raise StrategyError(f"Cannot read strategy file path={path!r}: {err}") from err
        proto = strategy_pb2.Strategy()
        try:
            proto.ParseFromString(data)
        except pb_message.DecodeError as err:
            raise StrategyError(
                f"File path={path!r} is not a binary Strategy proto: {err}") from err
        problems = []
        if not proto.id:
            problems.append("it has no id")
        if not proto.HasField("graph_config") and not proto.node_config:
            problems.append("it has neither a graph_config nor any node_config")
        if _unknown_field_count(proto):
            problems.append("it contains fields unknown to the Strategy schema")
        if problems:
            raise StrategyError(
                f"File path={path!r} ({len(data)} bytes) is not a valid strategy: "
                f"{'; '.join(problems)}.")
        return cls(proto)

    def copy(self) -> "Strategy":
        """Returns an independent deep copy with the same id.

        Returns:
            Strategy: the copy.
        """
        return Strategy(self._proto)

    def __str__(self) -> str:
        return text_format.MessageToString(self._proto)

    def __repr__(self) -> str:
        return (f"Strategy(id={self.id!r}, replicas={len(self._proto.graph_config.replicas)}, "
                f"node_configs={len(self._proto.node_config)})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Strategy):
            return NotImplemented
        return self._proto == other._proto

    __hash__ = None  # mutable; equality is by content


class StrategyBuilder(abc.ABC):
    """Interface of strategy builders.

    A builder is pure: ``build`` reads the graph item and the resource spec and
    returns a new :class:`Strategy`, changing neither argument.
    """

    @abc.abstractmethod
    def build(self, graph_item: Any, resource_spec: Any) -> Strategy:
        """Builds a strategy.

        Args:
            graph_item: exposes ``trainable_variables`` (list of ``VariableInfo``).
            resource_spec: the cluster (``autodist.resource_spec.ResourceSpec``).

        Returns:
            Strategy: a strategy with one node config per trainable variable.
        """

    def __repr__(self) -> str:
        params = ", ".join(f"{k.lstrip('_')}={v!r}" for k, v in sorted(vars(self).items()))
        return f"{type(self).__name__}({params})"
