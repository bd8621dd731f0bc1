"""Synchronizer kinds and compressors: one class each, selected by the strategy.

``KINDS`` maps each field of ``Strategy.Node``'s ``synchronizer`` oneof to its
class; it is checked against the proto at import, so a field without a class
(or a class without a field) fails at once. A kind's class owns everything
about it; no other module branches on the kind.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Type

from autodist.proto import strategy_pb2
from autodist.synchronizers.all_reduce import AllReduceSynchronizer
from autodist.synchronizers.base import SynchronizerKind
from autodist.synchronizers.ps import PSSynchronizer
from autodist.synchronizers.sharded_update import ShardedUpdateSynchronizer

_ONEOF = strategy_pb2.Strategy.Node.DESCRIPTOR.oneofs_by_name["synchronizer"]


def _registry(classes: List[Type[SynchronizerKind]]) -> Dict[str, Type[SynchronizerKind]]:
    """Oneof field -> class, in the proto's field order; fails when the two disagree."""
    fields = [field.name for field in _ONEOF.fields]
    by_field = {cls.field: cls for cls in classes}
    missing = [name for name in fields if name not in by_field]
    unknown = sorted(set(by_field) - set(fields))
    if missing or unknown:
        raise ImportError(f"Synchronizer registry out of step with the proto: oneof fields "
                          f"without a class {missing}, classes without a field {unknown}.")
    return {name: by_field[name] for name in fields}


KINDS = _registry([PSSynchronizer, AllReduceSynchronizer, ShardedUpdateSynchronizer])
"""``synchronizer`` oneof field -> its kind's class, in the proto's order."""


def kind_of(node) -> Optional[Type[SynchronizerKind]]:
    """The kind of a ``Strategy.Node`` (or part config); None when it has no synchronizer."""
    field = node.WhichOneof("synchronizer")
    return KINDS[field] if field else None
