"""The immutable facts every kernel is handed."""
from __future__ import annotations

import dataclasses


REPLICA_PREFIX = "AutoDist-Replica"


@dataclasses.dataclass(frozen=True)
class KernelContext:
    """Where this node's part of the graph runs.

    Attributes:
        replica_devices: strategy device strings of this node's replicas, in order.
        tf_devices: strategy device string -> TensorFlow device name.
        shared_device: TensorFlow device for shared ops (inputs, non-trainables).
    """

    replica_devices: tuple
    tf_devices: dict
    shared_device: str

    @property
    def num_replicas(self) -> int:
        return len(self.replica_devices)

    def tf_device(self, device: str) -> str:
        """TensorFlow device name of a strategy device string."""
        return self.tf_devices[device]

    def replica_tf_device(self, replica: int) -> str:
        return self.tf_devices[self.replica_devices[replica]]


def replica_scope(replica: int) -> str:
    """Name prefix of replica ``replica``'s copy of the model."""
    return f"{REPLICA_PREFIX}-{replica}"
