"""What every synchronizer kind provides, and the pieces kinds share.

A kind is a class (one per field of the strategy's ``synchronizer`` oneof). The
class holds the kind's checks; an instance synchronizes the parts of that kind
of one graph on one node, built by ``kernels/transformer.py`` in these steps:

1. ``create_storage``   each part's stored copies and what each replica reads;
2. ``synchronize``      the replicas' gradients reduced into the updates of the
                        copies the optimizer updates, with the ops of the
                        step's one or two runs;
3. ``after_local_updates``, ``end_step``
                        work after the updates (gathers, telling workers,
                        refreshes);
4. ``initialization``   which variables the chief owns, which start from
                        others, which another node initializes;
5. ``restore_targets``, ``slot_targets``, ``slot_value``
                        what a checkpoint restore assigns on this node and
                        what a save or fetch reads.

Before any of it, the compiler asks ``stored_copies`` how much of a part each
node stores, to refuse a strategy a node's memory cannot hold.

The class also tells the search about the kind, as numpy over the columns of a
strategy's parts (``simulator/traffic.py``'s ``SyncParts``): its columns
(``traffic_record``), its cost components (``cost``), which node updates what
(``update_shares``), the link and the traffic its parts share (the simulator's
features) and the sampler's choices (``sampling``).
"""
from __future__ import annotations

import dataclasses
import math
import random
from typing import Any, Callable, ClassVar, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from autodist.graph_item import PartUpdate
from autodist.kernel_context import KernelContext
from autodist.strategy import common

COLLECTIVE_GROUP_KEY = 1
# Sub-rings per device of an all-reduce: a merged group is one large buffer, and
# with a single ring every step copies a whole chunk before adding it; several
# overlap the transfer of one piece with the arithmetic of another
# (docs/notes/step_time.md).
RING_SUBDIVISIONS = 4


@dataclasses.dataclass
class PartStorage:
    """Where one variable part lives: its stored copies and what each replica reads.

    Attributes:
        part: the compiler's ``VariablePart``.
        copies: the copies holding the part's value on this node (first: the
            one a fetch reads).
        readers: per replica, the variable it reads.
        synchronizer: the kind's instance that made it.
        origin: a copy on the chief that the others start from, or None.
    """

    part: object
    copies: list
    readers: list
    synchronizer: "SynchronizerKind"
    origin: Optional[tf.Variable] = None


@dataclasses.dataclass(frozen=True)
class Target:
    """A variable a restore assigns, and the piece of the part's value it holds."""

    variable: tf.Variable
    take: Optional[Callable[[tf.Tensor], tf.Tensor]] = None  # None: the whole value


class Ownership(NamedTuple):
    """Who initializes which variables of a part.

    Attributes:
        chief: variables the chief initializes (workers wait for them).
        derived: copies initialized from another variable, in a second phase.
        elsewhere: variables in this node's graph that another node initializes.
        start_only: of ``chief``, those no node reads once every node has
            initialized its copies (an origin); the chief then drops them.
    """

    chief: Sequence = ()
    derived: Sequence = ()
    elsewhere: Sequence = ()
    start_only: Sequence = ()


class NodeLayout(NamedTuple):
    """The cluster as a strategy uses it, for :meth:`SynchronizerKind.stored_copies`.

    Attributes:
        chief: the chief's address.
        replicas: every node's address -> the strategy's replicas on it.
        cpu_replicas: every node's address -> those of its replicas that are CPU
            devices, whose variables live in the node's memory (a GPU's do not).
        split_step: a step is two runs (``KernelContext.split_step``).
    """

    chief: str
    replicas: Dict[str, int]
    cpu_replicas: Dict[str, int]
    split_step: bool

    @property
    def multi_node(self) -> bool:
        return len(self.replicas) > 1


class StoredCopies(NamedTuple):
    """How much of a part one node stores: copies of its value, and of its optimizer slots."""

    values: float
    slots: float


@dataclasses.dataclass
class Member:
    """One part to synchronize: its storage, each local replica's contribution, and how
    to turn the mean gradient into the update of its first copy.

    A contribution is the replica's gradient scaled by its share of the
    cluster's rows (``replicator.contribution_shares``): every kind adds the
    contributions of all replicas up, and their sum is the gradient of the
    loss averaged over the whole batch, the mean gradient.

    ``updates_rows``: the update writes only the rows of the sparse mean
    gradient (``VariableInfo.updates_rows``).

    ``node_sum``: builds the node's contributions already added up, where one
    product over the node's rows gives them (``kernels.node_products``); a kind
    that adds a node's contributions up before anything else takes them through
    :meth:`node_contributions`.
    """

    storage: PartStorage
    grads: list
    update: Callable[[object], PartUpdate]
    updates_rows: bool = False
    node_sum: Optional[Callable[[], tf.Tensor]] = None

    def node_contributions(self) -> list:
        """What this node adds up: its sum as one tensor where ``node_sum`` gives it,
        else each local replica's contribution."""
        return [self.node_sum()] if self.node_sum is not None else self.grads


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
        foreign_updates: updates of copies that other nodes update, built
            here only for their optimizer slots (which the chief saves and
            fetches); never run on this node.
    """

    local_ops: list = dataclasses.field(default_factory=list)
    local_updates: list = dataclasses.field(default_factory=list)
    remote_ops: list = dataclasses.field(default_factory=list)
    remote_updates: list = dataclasses.field(default_factory=list)
    foreign_updates: list = dataclasses.field(default_factory=list)


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


def local_variable(initial_value, name: str, shape=None) -> tf.Variable:
    """A variable of this node alone, in ``LOCAL_VARIABLES``: never saved, never shared.

    ``tf.Variable`` ignores ``collections`` and would make it a global variable.
    """
    return tf.compat.v1.Variable(initial_value, trainable=False, name=name, shape=shape,
                                 collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES],
                                 use_resource=True)


def balanced_groups(units: list, groups_per_dtype: int) -> Tuple[Dict[str, int], Dict[int, str]]:
    """Unit name -> collective group for ``units``, and group -> its dtype.

    A group's dense gradients share one buffer, so groups never mix dtypes: each
    dtype's units, in the order the backward pass computes their gradients, are
    cut into up to ``groups_per_dtype`` buckets of about equal bytes
    (:func:`common.even_buckets`), numbered on from the previous dtype's. Sparse
    units are gathered one by one whatever their group; they join group 0.

    Args:
        units: ``(var, plan)`` pairs of a sampler (``KindSampling.configs``).
    """
    by_dtype: Dict[str, List] = {}
    groups: Dict[str, int] = {}
    for var, plan in units:
        if var.sparse_grad:
            groups.update((name, 0) for name in plan.names)
        else:
            by_dtype.setdefault(var.dtype, []).extend(
                (name, size, var.ready_rank) for name, size in zip(plan.names, plan.sizes))
    dtypes: Dict[int, str] = {}
    next_group = 0
    for dtype, items in by_dtype.items():
        buckets = common.even_buckets(items, groups_per_dtype)
        groups.update((name, next_group + bucket) for name, bucket in buckets.items())
        count = max(buckets.values()) + 1
        dtypes.update((group, dtype) for group in range(next_group, next_group + count))
        next_group += count
    return groups, dtypes


def collective_numbers(parts, index: np.ndarray) -> np.ndarray:
    """The collective of each dense part ``index``, as a number per (group, dtype) pair.

    A kind reducing a group in one buffer has a buffer, and so a collective, per dtype.
    """
    return parts.group[index] * (parts.dtype.max(initial=0) + 1) + parts.dtype[index]


def launch_order(parts, index: np.ndarray) -> Tuple[np.ndarray, int]:
    """Each dense part's collective, numbered in the order the kernel launches them
    (of first appearance among ``index``), and how many collectives there are."""
    _, first, collective = np.unique(collective_numbers(parts, index), return_index=True,
                                     return_inverse=True)
    return np.argsort(np.argsort(first))[collective], len(first)


def backward_left(parts, dense: np.ndarray, collective: np.ndarray, launches: int,
                  split_step: bool) -> np.ndarray:
    """Per dense part ``dense``: the share of the backward pass left to run once its
    collective's last gradient is ready (``collective``, ``launches``: as
    :func:`launch_order` numbers them). None in a split step, whose reductions
    wait for its second run.

    The clock is the gradients' order (``ready_rank``): the share is that of the
    gradients ready after it, as if each cost the backward pass alike. It is rough
    (a convolution's gradient costs more than a dense layer's of the same bytes),
    and the weight of ``overlap`` says how much of it a cluster really hides. The
    last collective launched has none left; gradients without a known order (rank
    0 for all) get none either.
    """
    if split_step:
        return np.zeros(len(dense))
    ranks = parts.ready_rank[parts.has_grad]
    ranked = int(ranks.max()) + 1 if ranks.size else 1
    last = np.zeros(launches, dtype=np.int64)
    np.maximum.at(last, collective, parts.ready_rank[dense])
    return ((ranked - 1 - last) / ranked)[collective]


def most_groups(variables: list, constraints) -> int:
    """The most collective groups per dtype a sampler may draw: at most
    ``constraints.max_groups``, and no more than the units there can be."""
    # An upper bound of the synchronized units, the most groups that can be useful.
    units = sum(constraints.max_partitions if v.size_bytes > constraints.partition_threshold_bytes
                else 1 for v in variables if v.has_grad)
    return min(constraints.max_groups or units, units)


def draw_group_count(rng: random.Random, most: int) -> int:
    """How many collective groups per dtype, from 1 to ``most``, log-uniform.

    A uniform draw over hundreds of counts would almost never merge into a few
    large groups, often the fastest choice.
    """
    most = max(1, most)
    return max(1, min(most, int(math.exp(rng.uniform(0.0, math.log(most + 1))))))


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
        collective: its reduce runs collectives, which every node's step must
            join, whatever the config (else it overrides :meth:`uses_collectives`).
        remote_ops: its step runs ops on other nodes' devices, a server's,
            whatever the config (else it overrides :meth:`uses_remote_ops`).
        updates_on_every_node: on a cluster, every node applies the whole
            update of a part of this kind (an all-reduce), rather than one node
            (a parameter server's chief) or each a shard.
    """

    field: ClassVar[str]
    feature_name: ClassVar[str]
    collective: ClassVar[bool] = False
    remote_ops: ClassVar[bool] = False
    updates_on_every_node: ClassVar[bool] = False

    @classmethod
    def uses_collectives(cls, config) -> bool:
        """Whether a part of this config reduces through collectives on a cluster."""
        return cls.collective

    @classmethod
    def uses_remote_ops(cls, config) -> bool:
        """Whether a part of this config runs ops on other nodes' devices on a cluster."""
        return cls.remote_ops

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
    def update_shares(cls, parts, index: np.ndarray, nodes: List[str], server_node: np.ndarray,
                      cluster) -> np.ndarray:
        """``[node, part]``: the share of each part ``index`` that each node updates.

        Args:
            nodes: nodes of the step, those with replicas first (as in ``cluster``).
            server_node: per part, its server's index among ``nodes``, -1 for none.
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
    def check_variables(cls, variables: list, strategy_id: str, num_replicas: int) -> None:
        """Checks across parts, given every ``CompiledVariable`` and the replicas of the
        strategy; raises StrategyError."""

    @classmethod
    def stored_copies(cls, config, layout: NodeLayout) -> Dict[str, StoredCopies]:
        """Node address -> how much of a part of ``config`` its graph stores in that
        node's memory, as ``create_storage`` and the optimizer lay it out; copies on
        a GPU are not in it, and a node storing none may be missing."""
        raise NotImplementedError

    def __init__(self, ctx: KernelContext, keys: CollectiveKeys):
        self.ctx = ctx
        self.keys = keys

    def create_storage(self, part, initial_value: tf.Tensor) -> PartStorage:
        raise NotImplementedError

    def value_device(self, part) -> str:
        """Where the part's initial value is computed: where it is first stored (by
        default the chief, whose value every other node's copy starts from)."""
        return self.ctx.chief_device if self.ctx.multi_node else self.ctx.shared_device

    def initialization(self, storage: PartStorage) -> Ownership:
        return Ownership()

    def synchronize(self, members: List[Member]) -> Reduced:
        raise NotImplementedError

    def chief_init_ops(self) -> list:
        """Ops the chief of a cluster runs once at initialization, after ``synchronize``."""
        return []

    def after_local_updates(self, updated: dict) -> list:
        """Ops of the step's (first) run that follow this node's updates (collectives).

        Args:
            updated: variable name -> the op updating it, for the updates this node applies.
        """
        return []

    def end_step(self, steps: list, updated: dict) -> list:
        """The ops ending the step's (last) run, given ``steps``, the run's ops so far.

        Args:
            updated: variable name -> the op updating it, for the updates this node applies.
        """
        return steps

    def initialized_with_part(self, storage: PartStorage) -> list:
        """The variables on this node that running the part's initializer resets."""
        return _unique(storage.copies + storage.readers)

    def restore_targets(self, storage: PartStorage) -> List[Target]:
        """What a restore assigns the part's value to on this node."""
        return [Target(v) for v in _unique(storage.copies + storage.readers)]

    def slot_targets(self, storage: PartStorage, slot_of: Callable) -> List[Target]:
        """What a restore assigns the part's slot value to on this node.

        Args:
            slot_of: a variable the optimizer updates -> its slot, or None.
        """
        slots = [slot_of(copy) for copy in storage.copies]
        return [Target(slot) for slot in slots if slot is not None]

    def slot_value(self, storage: PartStorage, slot_of: Callable) -> Optional[PartReader]:
        """What reads the part's slot value (a ``reader``); None where this node cannot."""
        slot = slot_of(storage.copies[0])
        return reader(slot) if slot is not None else None


PartReader = Callable[..., tf.Tensor]
"""``read(rows=None)``: a part's value, whole, or only rows ``[begin, end)`` of its
axis 0 for ``rows=(begin, end)``."""


def reader(variable: tf.Variable) -> PartReader:
    """Reads ``variable`` whole, or some of its rows with a gather where it is stored,
    so that only those rows leave its device."""
    def read(rows: Optional[Tuple[int, int]] = None) -> tf.Tensor:
        if rows is None:
            return variable.read_value()
        return variable.sparse_read(tf.range(rows[0], rows[1]))
    return read


def _unique(variables: list) -> list:
    seen, result = set(), []
    for variable in variables:
        if id(variable) not in seen:
            seen.add(id(variable))
            result.append(variable)
    return result


def stash(name: str, contribution, ctx: KernelContext):
    """Keeps this node's contribution in local variables between a step's two runs.

    Returns:
        (op storing it, run by the first run; the stored value, read by the
        second), a dense tensor or IndexedSlices like ``contribution``
    """
    def holder(value, suffix):
        return local_variable(tf.zeros([0] * value.shape.rank, value.dtype),
                              f"{name}/stash_{suffix}", tf.TensorShape(None))

    with tf.device(ctx.shared_device):
        if isinstance(contribution, tf.IndexedSlices):
            indices = tf.cast(contribution.indices, tf.int64)
            values_var, indices_var = holder(contribution.values, "values"), holder(indices, "indices")
            store = tf.group(values_var.assign(contribution.values, read_value=False),
                             indices_var.assign(indices, read_value=False))
            return store, tf.IndexedSlices(values_var.read_value(), indices_var.read_value(),
                                           contribution.dense_shape)
        values_var = holder(contribution, "values")
        return values_var.assign(contribution, read_value=False), values_var.read_value()


PIECE_BYTES = 64 << 20
"""The most bytes one tensor carries from node to node. TensorFlow's gRPC transport
holds a whole message beside the tensor it is received into, so a tensor sent
whole costs its receiver twice its bytes for a while; large ones go in pieces."""


def slice_sizes(size: int, count: int) -> List[int]:
    """Elements of each of ``count`` slices of a buffer of ``size``: as even as can
    be, the first ``size % count`` slices one larger (a slice may be empty)."""
    base, extra = divmod(size, count)
    return [base + (index < extra) for index in range(count)]


def piece_sizes(size: int, itemsize: int) -> List[int]:
    """Elements of each piece a buffer of ``size`` elements of ``itemsize`` bytes
    travels in: as few as ``PIECE_BYTES`` allows (one for an empty buffer)."""
    most = max(1, PIECE_BYTES // itemsize)
    return slice_sizes(size, max(1, -(-size // most)))


def carried(value: tf.Tensor, source: str, target: str) -> tf.Tensor:
    """``value``, computed on device ``source``, as a tensor on device ``target``,
    sent in pieces of at most ``PIECE_BYTES`` (one piece when it is that small or its
    shape is not fully known)."""
    if not value.shape.is_fully_defined() or \
            value.shape.num_elements() * value.dtype.size <= PIECE_BYTES:
        return value
    with tf.device(source):
        pieces = tf.split(tf.reshape(value, [-1]),
                          piece_sizes(value.shape.num_elements(), value.dtype.size))
    with tf.device(target):
        return tf.reshape(tf.concat(pieces, 0), value.shape)


def dense_by_dtype(members: list) -> list:
    """The indices of a group's dense members, one list per dtype in the members' order:
    one buffer, and so one reduce, per dtype."""
    by_dtype = {}
    for i, (_, _, grads) in enumerate(members):
        if not isinstance(grads[0], tf.IndexedSlices):
            by_dtype.setdefault(grads[0].dtype, []).append(i)
    return list(by_dtype.values())


def flatten(grads: list) -> tf.Tensor:
    """A group's gradients of one replica as one flat buffer."""
    flat_shape = tf.constant([-1])  # one shape constant for all: large groups are common
    return tf.concat([tf.reshape(g, flat_shape) for g in grads], 0) if len(grads) > 1 \
        else tf.reshape(grads[0], flat_shape)


def unflatten(flat: tf.Tensor, grads: list) -> list:
    """``flat`` cut back into tensors shaped like ``grads``."""
    sizes = [g.shape.num_elements() for g in grads]
    return [tf.reshape(piece, g.shape) for piece, g in zip(tf.split(flat, sizes), grads)]


def token_queue(worker: int, ctx: KernelContext, purpose: str = "sync_token",
                device: str = "", vectors: bool = False) -> tf.queue.FIFOQueue:
    """The queue through which the chief lets worker ``worker`` go on.

    With the default ``purpose``, the worker's next step waits for a token; other
    purposes (e.g. a finished restore) get queues of their own, and so does each
    optimizer call after the first (``ctx.update_index``). The queue lives on
    ``device``, by default the chief's. Its tokens are int64 scalars, or with
    ``vectors`` int64 vectors of any length (rows an update wrote).
    """
    name = f"autodist_{purpose}_{worker}"
    if ctx.update_index:
        name += f"_update{ctx.update_index}"
    with tf.device(device or ctx.chief_device):
        return tf.queue.FIFOQueue(capacity=-1, dtypes=[tf.int64],
                                  shapes=None if vectors else [[]], shared_name=name, name=name)
