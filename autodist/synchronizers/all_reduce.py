"""AllReduce synchronizer: every node keeps a copy; gradients meet in collectives.

Dense gradients of the parts sharing a group are flattened into one buffer per
replica and reduced by a single TensorFlow collective (sum), then split back;
a group mixing dtypes (a mixed-precision model) has one buffer per dtype.
Sparse gradients are all-gathered (values and indices), which keeps them sparse.
Collective keys are derived from the strategy alone, so every node of a cluster
computes the same ones. A group whose spec is ``SCATTER_GATHER`` meets without
collective ops instead (``scatter_gather.py``).

A node's replicas share its one copy of each part (on the node's CPU; CPU
replicas share the host's memory): the collective leaves the same sum on every
replica, so one update per node is enough, and a model of hundreds of
variables on many replicas does not pay for a copy, optimizer slots and an
update per replica.
"""
from __future__ import annotations

import dataclasses
import math
import random
from typing import Dict, List

import numpy as np
import tensorflow as tf

from autodist.kernel_context import KernelContext, replica_scope
from autodist.network import ClusterView, in_order_sum, seconds
from autodist.proto import synchronizers_pb2
from autodist.strategy import common
from autodist.strategy.base import StrategyError
from autodist.synchronizers import scatter_gather
from autodist.synchronizers.base import (COLLECTIVE_GROUP_KEY, RING_SUBDIVISIONS,
                                         CollectiveKeys, KindCost, KindSampling, Member,
                                         NodeLayout, Ownership, PartStorage, Reduced,
                                         StoredCopies, SynchronizerKind, backward_left,
                                         balanced_groups,
                                         collective_numbers, dense_by_dtype, draw_group_count,
                                         draw_share, flatten, launch_order, most_groups,
                                         carried, unflatten)
from autodist.synchronizers.compressor import LOSSY, compressor_class

_CONFIG = synchronizers_pb2.AllReduceSynchronizer


class AllReduceSynchronizer(SynchronizerKind):
    """The kind of the ``AllReduceSynchronizer`` field: see the module docstring."""

    field = "AllReduceSynchronizer"
    feature_name = "all_reduce"
    updates_on_every_node = True

    @classmethod
    def uses_collectives(cls, config) -> bool:
        """All specs but ``SCATTER_GATHER`` run TensorFlow's collectives."""
        return config.spec != _CONFIG.SCATTER_GATHER

    @classmethod
    def uses_remote_ops(cls, config) -> bool:
        return config.spec == _CONFIG.SCATTER_GATHER

    # ------------------------------------------------------------ what the search asks

    @classmethod
    def traffic_record(cls, config, info, grad_bytes: float, devices: dict) -> tuple:
        compressor = config.compressor
        wire_bytes = compressor_class(compressor).wire_bytes(grad_bytes, info.dtype,
                                                              info.sparse_grad)
        return (wire_bytes, -1, False, 0, False, compressor, config.group)

    @classmethod
    def cost(cls, parts, index: np.ndarray, cluster: ClusterView, split_step: bool) -> KindCost:
        """The transfer, all-gather, latency, part-overhead and overlap components of the
        parts with a gradient.

        A dense group reduced by the ring costs ``2 (n - 1) / n * bytes /
        bandwidth`` for ``n`` replicas on the ring's slowest link
        (``ring_all_reduce``); one reduced by scatter-gather, what
        :func:`scatter_gather.transfer_seconds` says (``scatter_gather``). A
        sparse part is all-gathered, ``(n - 1) * bytes / bandwidth``. Reductions
        launched: one per dtype of a dense group, three per sparse part.

        ``overlap`` is each dense group's transfer time times the share of the
        backward pass still to run when its last gradient is ready
        (:func:`backward_left`): what its reduction can hide behind that
        compute; none in a split step.
        """
        index = index[parts.has_grad[index]]
        n = cluster.num_replicas
        if n < 2 or not index.size:
            return KindCost({}, [])
        gbps = cluster.ring_gbps()
        sparse = index[parts.sparse[index]]
        gather = seconds((n - 1) * parts.grad_bytes[sparse], gbps)
        dense = index[~parts.sparse[index]]
        collective, launches = launch_order(parts, dense)
        order = np.argsort(collective, kind="stable")  # collective by collective, as launched
        dense, collective = dense[order], collective[order]
        ring = parts.collective[dense]
        wire = parts.wire_bytes[dense]
        transfer = np.where(ring, seconds(2.0 * (n - 1) / n * wire, gbps),
                            scatter_gather.transfer_seconds(wire, cluster))
        hidden = transfer * backward_left(parts, dense, collective, launches, split_step)
        members = np.bincount(collective, minlength=launches)
        features = {"ring_all_reduce": in_order_sum(transfer[ring]),
                    "scatter_gather": in_order_sum(transfer[~ring]),
                    "all_gather": in_order_sum(gather),
                    "collective_latency": float(_GATHERS_PER_SPARSE_PART * len(sparse)
                                                + launches),
                    "all_reduce_part_overhead": float(len(index)),
                    "overlap": in_order_sum(hidden)}
        return KindCost(features, [
            (sparse, [("all_gather", gather, True),
                      ("collective_latency", float(_GATHERS_PER_SPARSE_PART), True),
                      ("all_reduce_part_overhead", 1.0, True)]),
            # A launch is shared evenly by its members.
            (dense, [("ring_all_reduce", transfer, ring),
                     ("scatter_gather", transfer, ~ring),
                     ("collective_latency", 1.0 / members[collective], True),
                     ("all_reduce_part_overhead", 1.0, True),
                     ("overlap", hidden, hidden > 0)])])

    @classmethod
    def update_shares(cls, parts, index: np.ndarray, nodes: List[str], server_node: np.ndarray,
                      cluster: ClusterView) -> np.ndarray:
        """Every node with replicas keeps a copy and updates it whole."""
        on_node = np.array([float(node in cluster.replicas_per_node) for node in nodes])
        return np.repeat(on_node[:, None], len(index), axis=1)

    @classmethod
    def link_gbps(cls, parts, index: np.ndarray, cluster: ClusterView) -> np.ndarray:
        return np.full(len(index), cluster.ring_gbps())

    @classmethod
    def traffic_keys(cls, parts, index: np.ndarray) -> np.ndarray:
        """Sparse parts share the gathers (0); dense ones their collective (from 1)."""
        _, collective = np.unique(collective_numbers(parts, index), return_inverse=True)
        return np.where(parts.sparse[index], 0, 1 + collective)

    @classmethod
    def sampling(cls, variables: list, resource_spec, constraints) -> KindSampling:
        return _AllReduceSampling(variables, constraints)

    # ------------------------------------------------------------ the graph

    @classmethod
    def check(cls, config, var_name: str, devices: set, strategy_id: str) -> None:
        if config.group < 0:
            raise StrategyError(f"Strategy {strategy_id}: '{var_name}' has group "
                                f"{config.group}; it must be 0 or more.")
        for field, enum in (("spec", _CONFIG.Spec), ("compressor", _CONFIG.Compressor)):
            value = getattr(config, field)
            if value not in enum.values():
                raise StrategyError(
                    f"Strategy {strategy_id}: '{var_name}' has {field} {value}, which is "
                    f"not one of {dict(zip(enum.keys(), enum.values()))}.")

    @classmethod
    def check_variables(cls, variables: list, strategy_id: str, num_replicas: int) -> None:
        """A group's dense gradients share one buffer, so its parts must agree on the
        compressor and the spec.

        Sparse gradients are gathered one by one, uncompressed, whatever their group.
        """
        for field, enum in (("compressor", _CONFIG.Compressor), ("spec", _CONFIG.Spec)):
            found = {}  # group -> {value -> a part name}
            for variable in variables:
                if not variable.info.has_grad or variable.info.sparse_grad:
                    continue
                for part in variable.parts:
                    if part.kind is cls:
                        sync = part.synchronizer
                        found.setdefault(sync.group, {}).setdefault(getattr(sync, field),
                                                                    part.name)
            for group, names in sorted(found.items()):
                if len(names) > 1:
                    listed = ", ".join(f"'{name}' {enum.Name(value)}"
                                       for value, name in sorted(names.items()))
                    raise StrategyError(
                        f"Strategy {strategy_id}: all-reduce group {group} mixes {field}s "
                        f"({listed}); a group's gradients share one buffer, so give them one "
                        f"{field} or separate groups.")

    @classmethod
    def stored_copies(cls, config, layout: NodeLayout) -> Dict[str, StoredCopies]:
        return node_copies(layout)

    def create_storage(self, part, initial_value: tf.Tensor) -> PartStorage:
        copy, origin = create_all_reduce_storage(part.name, initial_value, self.ctx)
        return PartStorage(part, [copy], [copy] * self.ctx.num_replicas, self, origin)

    def initialization(self, storage: PartStorage) -> Ownership:
        if storage.origin is None:
            return Ownership()
        return Ownership(chief=[storage.origin], derived=list(storage.copies),
                         start_only=[storage.origin])

    def synchronize(self, members: List[Member]) -> Reduced:
        out = Reduced()
        groups = {}
        for member in members:
            groups.setdefault(member.storage.part.synchronizer.group, []).append(member)
        for group in sorted(groups):
            grouped = groups[group]
            if grouped[0].storage.part.synchronizer.spec == _CONFIG.SCATTER_GATHER:
                entries = [(m.storage.part.name, m.storage.part.synchronizer,
                            m.node_contributions()) for m in grouped]
                means, stores, sends = scatter_gather.reduce_group(entries, self.keys, self.ctx)
                out.local_ops.extend(stores)
                out.remote_ops.extend(sends)
                # A split step's second run exchanges what its first run stored.
                updates = out.remote_updates if self.ctx.split_step else out.local_updates
            else:
                entries = [(m.storage.part.name, m.storage.part.synchronizer, m.grads)
                           for m in grouped]
                means, others = all_reduce_group(entries, self.keys, self.ctx)
                out.local_ops.extend(others)
                updates = out.local_updates
            updates.extend(m.update(mean) for m, mean in zip(grouped, means))
        return out


def node_copies(layout: NodeLayout) -> Dict[str, StoredCopies]:
    """What :func:`create_all_reduce_storage` stores: a copy per node, updated there
    (its slots too), and on a cluster the origin on the chief (while the nodes start)."""
    return {node: StoredCopies(1 + (layout.multi_node and node == layout.chief), 1)
            for node in layout.replicas}


def create_all_reduce_storage(name: str, initial_value: tf.Tensor, ctx: KernelContext):
    """This node's copy of the part, on its CPU, read by all its replicas.

    On a cluster every node's copy starts from an origin variable on the chief,
    so they agree even when the initializer is random and unseeded; the chief
    drops it once every node has started (``Ownership.start_only``).

    Returns:
        (the copy, origin variable or None)
    """
    origin = None
    if ctx.multi_node:
        with tf.device(ctx.chief_device):
            origin = tf.Variable(initial_value, trainable=False, name=f"{name}/origin")
            start = origin.read_value()
        initial_value = carried(start, ctx.chief_device, ctx.shared_device)
    with tf.device(ctx.shared_device):
        return tf.Variable(initial_value, name=name), origin


def all_reduce_group(members: list, keys: CollectiveKeys, ctx: KernelContext) -> tuple:
    """Reduces the gradients of one group across all replicas.

    Args:
        members: list of (part name, its AllReduceSynchronizer, [grad per local
            replica]) in a fixed order; the compiler has checked that the dense
            ones agree on the compressor.

    Returns:
        (list parallel to ``members`` of the mean gradient, taken from this
        node's first replica; the other replicas' collectives, which must run too)
    """
    group_size = ctx.total_replicas
    means = [None] * len(members)
    others = []
    for dense in dense_by_dtype(members):
        key = keys.take()
        name, sync, _ = members[dense[0]]
        for replica in range(ctx.num_replicas):
            with tf.device(ctx.replica_tf_device(replica)):
                grads = [members[i][2][replica] for i in dense]
                scope = f"{replica_scope(replica)}/{name}"
                summed, unpack = _reduce_dense(grads, sync, group_size, key, scope)
                if replica == 0:
                    for i, grad in zip(dense, unpack(summed)):
                        means[i] = grad
                else:
                    others.append(summed.op)
    for i, (_, _, grads) in enumerate(members):
        if not isinstance(grads[0], tf.IndexedSlices):
            continue
        sparse_keys = (keys.take(), keys.take(), keys.take())
        for replica in range(ctx.num_replicas):
            with tf.device(ctx.replica_tf_device(replica)):
                gathered = _gather_sparse(grads[replica], group_size, sparse_keys)
                if replica == 0:
                    means[i] = _real_rows(*gathered, grads[replica])
                else:
                    others.extend(t.op for t in gathered)
    return means, others


def _reduce_dense(grads: list, sync, group_size: int, key: int, scope: str) -> tuple:
    """One replica's collective of a group: (its output, a function unpacking the mean)."""
    compressor = compressor_class(sync.compressor)(scope)
    wire, ctx = compressor.compress(flatten(grads))
    summed = tf.raw_ops.CollectiveReduceV2(
        input=wire, group_size=group_size, group_key=COLLECTIVE_GROUP_KEY,
        instance_key=key, ordering_token=[], merge_op="Add", final_op="Id",
        max_subdivs_per_device=RING_SUBDIVISIONS)

    def unpack(summed):
        return unflatten(compressor.decompress(summed, ctx), grads)
    return summed, unpack


# Instance keys of sparse gathers: one per gather and padded size, above the
# keys CollectiveKeys hands out.
_SIZED_KEY_BASE = 1 << 24
_SIZE_CLASSES = 48


def _gather_sparse(grad: tf.IndexedSlices, group_size: int, keys: tuple) -> tuple:
    """All-gathers an IndexedSlices gradient: (values, indices) of every replica.

    Replicas may hold different numbers of rows (a partition owns the rows whose
    ids fall in its range, a short batch has fewer), but a gather needs equal
    shapes: every replica pads to the power of two above the largest count
    with rows of index -1, dropped by :func:`_real_rows`. The extra row
    keeps the gather from ever being empty, which crashes the collective.

    TensorFlow resolves a collective's shape once per instance key and then
    holds every later run of that key to it, so each padded size gathers under
    a key of its own (at most one per power of two).
    """
    count_key, value_key, index_key = keys
    indices = tf.cast(grad.indices, tf.int64)
    count = tf.shape(indices, out_type=tf.int64)[:1]
    longest = tf.reduce_max(_gather(count, group_size, count_key))
    size_class = _ceil_log2(longest + 1)
    padding = tf.bitwise.left_shift(tf.constant(1, tf.int64), size_class) - count[0]
    values = tf.pad(grad.values, [[0, padding]] + [[0, 0]] * (grad.values.shape.rank - 1))
    indices = tf.pad(indices, [[0, padding]], constant_values=-1)

    def sized_key(key):
        return tf.cast(_SIZED_KEY_BASE + key * _SIZE_CLASSES + size_class, tf.int32)

    return (_gather(values, group_size, sized_key(value_key)),
            _gather(indices, group_size, sized_key(index_key)))


def _ceil_log2(value: tf.Tensor) -> tf.Tensor:
    """The smallest int64 ``b`` with ``2 ** b >= value``, for ``value >= 1``."""
    guess = tf.cast(tf.math.ceil(tf.math.log(tf.cast(value, tf.float64)) / math.log(2.0)),
                    tf.int64)
    one = tf.constant(1, tf.int64)
    # Correct a floating-point rounding either way.
    guess = tf.where(tf.bitwise.left_shift(one, guess) < value, guess + 1, guess)
    return tf.where((guess > 0) & (tf.bitwise.left_shift(one, tf.maximum(guess - 1, 0))
                                   >= value), guess - 1, guess)


def _real_rows(values: tf.Tensor, indices: tf.Tensor,
               grad: tf.IndexedSlices) -> tf.IndexedSlices:
    """The gathered rows without the padding (index -1): their sum is the mean gradient."""
    real = indices >= 0
    return tf.IndexedSlices(tf.boolean_mask(values, real),
                            tf.boolean_mask(indices, real), grad.dense_shape)


def _gather(tensor: tf.Tensor, group_size: int, instance_key: int) -> tf.Tensor:
    return tf.raw_ops.CollectiveGatherV2(
        input=tensor, group_size=group_size, group_key=COLLECTIVE_GROUP_KEY,
        instance_key=instance_key, ordering_token=[])


# --------------------------------------------------------------------------- costs and sampling

_GATHERS_PER_SPARSE_PART = 3  # the kernel gathers row counts, values and indices
_SAMPLED_SPECS = ("AUTO", "SCATTER_GATHER")
"""The implementations the sampler draws, one per sample: the ring, or send/recv."""


@dataclasses.dataclass(frozen=True)
class _Knobs:
    groups: int          # groups per gradient dtype
    fp16_share: float    # of the floating groups, compressed (when lossy choices are allowed)
    spec: str            # every group's all-reduce implementation


class _AllReduceSampling(KindSampling):
    """The sampler's AllReduce choices: how many groups, their compressors, the ring or
    scatter-gather; balanced groups."""

    def __init__(self, variables: list, constraints):
        self._constraints = constraints
        self._most_groups = most_groups(variables, constraints)

    def allowed(self, var) -> bool:
        return not var.sparse_grad or self._constraints.sparse_all_reduce

    def draw_knobs(self, rng: random.Random) -> _Knobs:
        c = self._constraints
        return _Knobs(draw_group_count(rng, self._most_groups),
                      draw_share(rng) if c.allow_fp16 else 0.0, rng.choice(_SAMPLED_SPECS))

    def configs(self, units: list, knobs: _Knobs, rng: random.Random) -> Dict[str, object]:
        """Buckets of about equal bytes in backward order (:func:`balanced_groups`); a
        group's compressor is drawn once for all its units."""
        groups, dtypes = balanced_groups(units, knobs.groups)
        compressors: Dict[int, str] = {}
        for group, dtype in dtypes.items():
            lossy = (np.issubdtype(np.dtype(dtype), np.floating)
                     and rng.random() < knobs.fp16_share)
            compressors[group] = rng.choice(LOSSY) if lossy else "NoneCompressor"
        compressors.setdefault(0, "NoneCompressor")
        # One config per compressor, copied per group: the helper's enum lookups
        # run a few times per sample rather than once per group.
        by_compressor = {name: common.ar_node_config("", 0, knobs.spec, name)
                         for name in set(compressors.values())}
        templates = {}
        for group, name in compressors.items():
            templates[group] = common.Node()
            templates[group].CopyFrom(by_compressor[name])
            templates[group].AllReduceSynchronizer.group = group
        return {name: templates[group] for name, group in groups.items()}
