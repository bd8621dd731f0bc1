"""The immutable facts every kernel is handed."""
from __future__ import annotations

import dataclasses


REPLICA_PREFIX = "AutoDist-Replica"


@dataclasses.dataclass(frozen=True)
class KernelContext:
    """Where this node's part of the graph runs, and what the rest of the cluster is.

    Attributes:
        replica_devices: strategy device strings of this node's replicas, in order.
        tf_devices: strategy device string -> TensorFlow device name, for every
            device of the cluster.
        shared_device: this node's device for shared ops (inputs, pipelines).
        chief_device: the chief's CPU, home of shared non-trainable variables; the
            same as ``shared_device`` on one node.
        node_index: this node's position in the cluster; 0 is the chief.
        num_nodes: nodes in the cluster.
        group_size: replicas in the whole cluster (0: this node's replicas).
        all_replicas: strategy device strings of every replica of the cluster,
            in the strategy's order (empty: this node's replicas).
        node_devices: every node's device for shared ops, in node order (empty:
            this node's ``shared_device`` alone).
        has_collectives: parts with a gradient reduce through collectives
            (``SynchronizerKind.uses_collectives``).
        has_remote_ops: parts with a gradient run ops on other nodes' devices
            (``SynchronizerKind.uses_remote_ops``).
        state_per_node: keep the non-trainable variables per node even where a
            cluster could keep one copy on the chief (a Keras model's metrics
            and batch-norm statistics, which every node's model reads back).
        updates_on_every_node: every node applies the whole update of every
            part (``SynchronizerKind.updates_on_every_node``; always on one node).
        update_index: which optimizer call of the graph the kernels are
            synchronizing (0 for the first; a graph may have several).
    """

    replica_devices: tuple
    tf_devices: dict
    shared_device: str
    chief_device: str = ""
    node_index: int = 0
    num_nodes: int = 1
    group_size: int = 0
    all_replicas: tuple = ()
    node_devices: tuple = ()
    has_collectives: bool = False
    has_remote_ops: bool = False
    state_per_node: bool = False
    updates_on_every_node: bool = True
    update_index: int = 0

    @property
    def num_replicas(self) -> int:
        return len(self.replica_devices)

    @property
    def total_replicas(self) -> int:
        return self.group_size or self.num_replicas

    @property
    def replicas(self) -> tuple:
        """Every replica of the cluster, in the strategy's order."""
        return self.all_replicas or self.replica_devices

    def replica_index(self, replica: int) -> int:
        """This node's replica ``replica``'s position among :attr:`replicas`."""
        return self.replicas.index(self.replica_devices[replica])

    @property
    def is_chief(self) -> bool:
        return self.node_index == 0

    @property
    def multi_node(self) -> bool:
        return self.num_nodes > 1

    @property
    def collective_steps(self) -> bool:
        """Cross-node collectives run in the training step.

        TensorFlow then gives every node's step the same id, and the end of one
        node's step aborts whatever another node's step still does on its task:
        such a step must stay on the node's own devices.
        """
        return self.multi_node and self.has_collectives

    @property
    def split_step(self) -> bool:
        """A step is two runs: a local one with the collectives, then the other nodes' ops."""
        return splits_step(self.num_nodes, self.has_collectives, self.has_remote_ops)

    @property
    def shared_variables_on_chief(self) -> bool:
        """One copy of the non-trainables (a global step) on the chief, or one per node."""
        return self.multi_node and not self.collective_steps and not self.state_per_node

    @property
    def variable_device(self) -> str:
        """Where the shared non-trainable variables live."""
        return self.chief_device if self.shared_variables_on_chief else self.shared_device

    @property
    def nodes(self) -> tuple:
        """Every node's device for shared ops, in node order."""
        return self.node_devices or (self.shared_device,)

    def tf_device(self, device: str) -> str:
        """TensorFlow device name of a strategy device string."""
        return self.tf_devices[device]

    def replica_tf_device(self, replica: int) -> str:
        return self.tf_devices[self.replica_devices[replica]]


def splits_step(num_nodes: int, has_collectives: bool, has_remote_ops: bool) -> bool:
    """Whether a step is two runs (``KernelContext.split_step``): on a cluster whose step
    runs collectives, which must stay on each node's devices, and ops on other nodes'."""
    return num_nodes > 1 and has_collectives and has_remote_ops


def replica_scope(replica: int) -> str:
    """Name prefix of replica ``replica``'s copy of the model."""
    return f"{REPLICA_PREFIX}-{replica}"
