"""What every synchronizer kind provides, and the pieces kinds share.

A kind is a class (one per field of the strategy's ``synchronizer`` oneof). The
class holds the kind's checks; an instance synchronizes the parts of that kind
of one graph on one node, built by ``kernels/transformer.py`` in these steps:

1. ``create_storage``   each part's stored copies and what each replica reads;
2. ``initialization``   which copies the chief owns, which start from others;
3. ``synchronize``      the replicas' gradients reduced into one mean per part,
                        with the ops of the step's one or two runs;
4. ``end_step``         work after the updates (telling workers, refreshes);
5. ``restore_targets``  the copies a checkpoint restore assigns on this node.

The class also tells the search about the kind, as numpy over the columns of a
strategy's parts (``simulator/traffic.py``'s ``SyncParts``): its columns
(``traffic_record``), its cost components (``cost``), which node updates what
(``update_shares``), the link and the traffic its parts share (the simulator's
features) and the sampler's choices (``sampling``).
"""
from __future__ import annotations

import dataclasses
import random
from typing import Any, Callable, ClassVar, Dict, List, NamedTuple, Optional, Tuple

import numpy as np
import tensorflow as tf

from autodist.graph_item import PartUpdate
from autodist.kernel_context import KernelContext

COLLECTIVE_GROUP_KEY = 1


@dataclasses.dataclass
class PartStorage:
    """Where one variable part lives: its stored copies and what each replica reads.

    Attributes:
        part: the compiler's ``VariablePart``.
        copies: the copies the optimizer updates on this node (first: the one
            whose value is the part's).
        readers: per replica, the variable it reads.
        synchronizer: the kind's instance that made it.
        origin: a copy on the chief that the others start from, or None.
    """

    part: object
    copies: list
    readers: list
    synchronizer: "SynchronizerKind"
    origin: Optional[tf.Variable] = None


@dataclasses.dataclass
class Member:
    """One part to synchronize: its storage, each local replica's gradient, and how to
    turn the mean gradient into the update of its first copy."""

    storage: PartStorage
    grads: list
    update: Callable[[object], PartUpdate]


@dataclasses.dataclass
class Reduced:
    """What a kind's ``synchronize`` produced.

    A step on a cluster that mixes a kind with collectives and one with ops on
    other nodes' devices is split in two runs (``KernelContext.split_step``):
    ``local_*`` run in the first, ``remote_*`` in the second. Otherwise one
    run does all.

    Attributes:
        local_ops: ops the first run must run besides the updates (other
            replicas' collectives, stashes of gradients for the second run).
        local_updates: updates applied in the first run.
        remote_ops: ops the second run must run (sends to other nodes).
        remote_updates: updates applied in the second run.
    """

    local_ops: list = dataclasses.field(default_factory=list)
    local_updates: list = dataclasses.field(default_factory=list)
    remote_ops: list = dataclasses.field(default_factory=list)
    remote_updates: list = dataclasses.field(default_factory=list)


class CollectiveKeys:
    """Hands out instance keys in the (deterministic) order collectives are built.

    One per graph, shared by every kind that launches collectives: every node
    builds them in the same order, so the keys agree across the cluster.
    """

    def __init__(self):
        self._next = 1

    def take(self) -> int:
        key = self._next
        self._next += 1
        return key


class KindCost(NamedTuple):
    """What a kind's parts cost per step, unweighted (see ``simulator/cost_model.py``).

    Attributes:
        features: cost component -> its value for these parts.
        charges: ``(parts, [(component, value, charged), ...])`` pairs: for the
            parts (indices), each component's value and whether it is charged,
            per part or one for all; listed part by part in this order.
        binding: the resources that bind these parts' traffic, for the report, or None.
    """

    features: Dict[str, float]
    charges: List[Tuple[np.ndarray, List[tuple]]]
    binding: Optional[str] = None


class KindSampling:
    """A kind's choices in a strategy sampler (``search/sampler.py``), for one graph and cluster."""

    def allowed(self, var) -> bool:
        """Whether the kind may synchronize ``var`` (a ``VariableInfo``) at all."""
        return True

    def draw_knobs(self, rng: random.Random) -> Any:
        """The kind's strategy-wide choices of one sample."""
        return None

    def plan(self, var, knobs, rng: random.Random) -> Any:
        """The kind's choices for one variable it got."""
        return None

    def configs(self, units: list, knobs, rng: random.Random) -> Dict[str, Any]:
        """Unit name -> the node config it copies, for ``units``: ``(var, plan)`` pairs,
        the ``plan`` having ``names`` and ``sizes`` of the units and the kind's ``choices``."""
        raise NotImplementedError


def draw_share(rng: random.Random) -> float:
    """A share in [0, 1]: 0 or 1 a quarter of the time each, else uniform."""
    draw = rng.random()
    if draw < 0.5:
        return float(draw >= 0.25)
    return rng.random()


class SynchronizerKind:
    """A synchronizer kind; see the module docstring for the order of the calls.

    Attributes:
        field: its field in the strategy's ``synchronizer`` oneof.
        feature_name: its name in the simulator's features (``<name>_share``).
        collective: its reduce runs collectives, which every node's step must join.
        remote_ops: its step runs ops on other nodes' devices (a server's).
    """

    field: ClassVar[str]
    feature_name: ClassVar[str]
    collective: ClassVar[bool] = False
    remote_ops: ClassVar[bool] = False

    # ------------------------------------------------------------ what the search asks

    @classmethod
    def traffic_record(cls, config, info, grad_bytes: float, devices: Dict[str, int]) -> tuple:
        """A part's own columns of ``SyncParts``: ``(wire_bytes, server, proxy,
        staleness, aggregate, compressor, group)``; ``server`` numbered in ``devices``
        (add a new one at ``len(devices)``), -1 for none."""
        raise NotImplementedError

    @classmethod
    def cost(cls, parts, index: np.ndarray, cluster, split_step: bool) -> KindCost:
        """What the parts ``index`` of ``parts`` cost on ``cluster`` (a ``network.ClusterView``)."""
        raise NotImplementedError

    @classmethod
    def update_shares(cls, parts, index: np.ndarray, num_nodes: int, server_node: np.ndarray,
                      replica_nodes: int) -> np.ndarray:
        """``[node, part]``: the share of each part ``index`` that each node updates.

        Args:
            num_nodes: nodes of the step: first the ``replica_nodes`` with replicas.
            server_node: per part, its server's index among the nodes, -1 for none.
        """
        raise NotImplementedError

    @classmethod
    def link_gbps(cls, parts, index: np.ndarray, cluster) -> np.ndarray:
        """The rate of the link each part ``index`` meets."""
        raise NotImplementedError

    @classmethod
    def traffic_keys(cls, parts, index: np.ndarray) -> np.ndarray:
        """A number per part ``index``, equal for parts that share their traffic
        (a server, a collective), from 0."""
        raise NotImplementedError

    @classmethod
    def sampling(cls, variables: list, resource_spec, constraints) -> KindSampling:
        """The kind's choices in a sampler of strategies for ``variables``."""
        raise NotImplementedError

    # ------------------------------------------------------------ the graph

    @classmethod
    def check(cls, config, var_name: str, devices: set, strategy_id: str) -> None:
        """Raises StrategyError naming the field of ``config`` that is invalid."""

    @classmethod
    def check_variables(cls, variables: list, strategy_id: str) -> None:
        """Checks across parts, given every ``CompiledVariable``; raises StrategyError."""

    def __init__(self, ctx: KernelContext, keys: CollectiveKeys):
        self.ctx = ctx
        self.keys = keys

    def create_storage(self, part, initial_value: tf.Tensor) -> PartStorage:
        raise NotImplementedError

    def initialization(self, storage: PartStorage) -> Tuple[list, list]:
        """(variables the chief owns and initializes, copies initialized from another)."""
        return [], []

    def synchronize(self, members: List[Member]) -> Reduced:
        raise NotImplementedError

    def chief_init_ops(self) -> list:
        """Ops the chief of a cluster runs once at initialization, after ``synchronize``."""
        return []

    def end_step(self, steps: list, updated: dict) -> list:
        """The ops ending the step's (last) run, given ``steps``, the run's ops so far.

        Args:
            updated: variable name -> the op updating it, for the updates this node applies.
        """
        return steps

    def restore_targets(self, storage: PartStorage) -> list:
        """The variables on this node a restore assigns the part's value to."""
        return _unique(storage.copies + storage.readers)


def _unique(variables: list) -> list:
    seen, result = set(), []
    for variable in variables:
        if id(variable) not in seen:
            seen.add(id(variable))
            result.append(variable)
    return result


def token_queue(worker: int, ctx: KernelContext, purpose: str = "sync_token",
                device: str = "") -> tf.queue.FIFOQueue:
    """The queue through which the chief lets worker ``worker`` go on.

    With the default ``purpose``, the worker's next step waits for a token; other
    purposes (e.g. a finished restore) get queues of their own. The queue lives
    on ``device``, by default the chief's.
    """
    name = f"autodist_{purpose}_{worker}"
    with tf.device(device or ctx.chief_device):
        return tf.queue.FIFOQueue(capacity=-1, dtypes=[tf.int64], shapes=[[]],
                                  shared_name=name, name=name)
