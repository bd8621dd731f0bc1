"""Sharded-update synchronizer (ZeRO stage 1): each replica updates only its shard.

Every node keeps one copy of the part, which its replicas read, as AllReduce
does. Each step:

1. the replicas' gradients of one group (and dtype) are flattened into one
   buffer and reduced by TensorFlow's ring collective (sum); each replica
   keeps its shard of the result;
2. each replica applies the optimizer to its shard, a variable of
   ``ceil(n / R)`` elements of the flattened part on its own device, with that
   shard's optimizer slots only: for R replicas, 1/R of the optimizer's
   memory and update work per replica;
3. the updated shards are all-gathered, and every node writes them into its copy.

TensorFlow's CPU collectives implement no reduce-scatter (its reduce-scatter and
all-to-all collectives are NCCL-only), so step 1 is a whole all-reduce: the kind
moves a ring all-reduce's bytes plus an all-gather's, 1.5 times AllReduce's.

The last shard is padded with zeros to the others' size, since a gather needs
equal shapes; its padding gets a zero gradient, so elementwise optimizers keep
it at zero. Checkpoints keep the single-device layout: a save stitches the
shards' slots, a restore hands each shard its piece. On a cluster the chief's
graph also holds the other nodes' shards, on their devices (initialized and
updated by their owners), so that it saves and fetches every slot.
"""
from __future__ import annotations

import dataclasses
import math
import random
from typing import Dict, List

import numpy as np
import tensorflow as tf

from autodist.kernel_context import replica_scope
from autodist.network import ClusterView, in_order_sum, seconds
from autodist.strategy import common
from autodist.strategy.base import StrategyError
from autodist.synchronizers.all_reduce import create_all_reduce_storage, node_copies
from autodist.synchronizers.base import (COLLECTIVE_GROUP_KEY, RING_SUBDIVISIONS, KindCost,
                                         KindSampling, Member, NodeLayout, Ownership,
                                         PartStorage, Reduced, StoredCopies, SynchronizerKind,
                                         Target, backward_left,
                                         balanced_groups, collective_numbers, draw_group_count,
                                         launch_order, most_groups)

_COLLECTIVES_PER_GROUP = 2  # the reduce and the gather of the shards' order; a gather per part


@dataclasses.dataclass
class _Layout:
    """How one part is cut: ``size`` elements, ``shard`` per replica, the last padded.

    Attributes:
        shards: global replica index -> its shard variable, for the shards this
            node's graph holds.
    """

    size: int
    shard: int
    padding: int
    shards: Dict[int, tf.Variable] = dataclasses.field(default_factory=dict)

    def piece(self, value: tf.Tensor, replica: int) -> tf.Tensor:
        """Replica ``replica``'s shard of ``value`` (any shape of ``size`` elements).

        Sliced first, then padded: only a shard past the part's end is copied.
        """
        start = replica * self.shard
        stop = min(start + self.shard, self.size)
        piece = tf.reshape(value, [-1])[start:stop]
        if stop - start < self.shard:
            piece = tf.pad(piece, [[0, self.shard - max(stop - start, 0)]])
        return piece


class ShardedUpdateSynchronizer(SynchronizerKind):
    """The kind of the ``ShardedUpdateSynchronizer`` field: see the module docstring."""

    field = "ShardedUpdateSynchronizer"
    feature_name = "sharded_update"
    collective = True

    @classmethod
    def check(cls, config, var_name: str, devices: set, strategy_id: str) -> None:
        if config.group < 0:
            raise StrategyError(f"Strategy {strategy_id}: '{var_name}' has group "
                                f"{config.group}; it must be 0 or more.")

    @classmethod
    def check_variables(cls, variables: list, strategy_id: str, num_replicas: int) -> None:
        for variable in variables:
            for part in variable.parts:
                if part.kind is not cls:
                    continue
                if variable.info.sparse_grad:
                    raise StrategyError(
                        f"Strategy {strategy_id}: '{part.name}' has a sparse gradient, and "
                        "ShardedUpdateSynchronizer takes dense ones only; synchronize it with "
                        "AllReduceSynchronizer (ShardedUpdateAR does).")
                elements = math.prod(part.shape)
                if elements < num_replicas:
                    raise StrategyError(
                        f"Strategy {strategy_id}: '{part.name}' has {elements} elements, fewer "
                        f"than the {num_replicas} replicas that would each update a shard; "
                        "synchronize it with AllReduceSynchronizer (ShardedUpdateAR does).")

    @classmethod
    def stored_copies(cls, config, layout: NodeLayout) -> Dict[str, StoredCopies]:
        """AllReduce's copies, plus the shards of the node's CPU replicas with their slots."""
        total = sum(layout.replicas.values())
        return {node: StoredCopies(copies.values + layout.cpu_replicas[node] / total,
                                   layout.cpu_replicas[node] / total)
                for node, copies in node_copies(layout).items()}

    # ------------------------------------------------------------ what the search asks

    @classmethod
    def traffic_record(cls, config, info, grad_bytes: float, devices: dict) -> tuple:
        return (grad_bytes, -1, False, 0, False, 0, config.group)

    @classmethod
    def cost(cls, parts, index: np.ndarray, cluster: ClusterView, split_step: bool) -> KindCost:
        """A ring all-reduce of the gradients and an all-gather of the updated shards;
        two collectives per group and dtype and one per part; the part overhead of
        all-reduced parts; the gradients' reduction overlapping the backward pass as
        an all-reduce group's does (``AllReduceSynchronizer.cost``)."""
        index = index[parts.has_grad[index]]
        n = cluster.num_replicas
        if n < 2 or not index.size:
            return KindCost({}, [])
        gbps = cluster.ring_gbps()
        collective, launches = launch_order(parts, index)
        order = np.argsort(collective, kind="stable")
        index, collective = index[order], collective[order]
        members = np.bincount(collective, minlength=launches)
        ring = seconds(2.0 * (n - 1) / n * parts.wire_bytes[index], gbps)
        gather = seconds((n - 1) / n * parts.value_bytes[index], gbps)
        hidden = ring * backward_left(parts, index, collective, launches, split_step)
        features = {"ring_all_reduce": in_order_sum(ring), "all_gather": in_order_sum(gather),
                    "collective_latency": float(_COLLECTIVES_PER_GROUP * launches
                                                + len(index)),
                    "all_reduce_part_overhead": float(len(index)),
                    "overlap": in_order_sum(hidden)}
        return KindCost(features, [(index, [
            ("ring_all_reduce", ring, True), ("all_gather", gather, True),
            ("collective_latency", _COLLECTIVES_PER_GROUP / members[collective] + 1.0, True),
            ("all_reduce_part_overhead", 1.0, True), ("overlap", hidden, hidden > 0)])])

    @classmethod
    def update_shares(cls, parts, index: np.ndarray, nodes: List[str], server_node: np.ndarray,
                      cluster: ClusterView) -> np.ndarray:
        """Each node updates its replicas' shards: their share of every part."""
        share = np.array([cluster.replicas_per_node.get(node, 0) / cluster.num_replicas
                          for node in nodes])
        return np.repeat(share[:, None], len(index), axis=1)

    @classmethod
    def link_gbps(cls, parts, index: np.ndarray, cluster: ClusterView) -> np.ndarray:
        return np.full(len(index), cluster.ring_gbps())

    @classmethod
    def traffic_keys(cls, parts, index: np.ndarray) -> np.ndarray:
        return np.unique(collective_numbers(parts, index), return_inverse=True)[1]

    @classmethod
    def sampling(cls, variables: list, resource_spec, constraints) -> KindSampling:
        return _ShardedSampling(variables, resource_spec, constraints)

    # ------------------------------------------------------------ the graph

    def __init__(self, ctx, keys):
        super().__init__(ctx, keys)
        self._layouts: Dict[str, _Layout] = {}
        # This node's replicas' positions among all replicas: the shards it updates.
        self._local = [ctx.replica_index(r) for r in range(ctx.num_replicas)]
        self._gathers = []  # per reduce: its members, a gather key per member, the order's key

    def create_storage(self, part, initial_value: tf.Tensor) -> PartStorage:
        ctx = self.ctx
        copy, origin = create_all_reduce_storage(part.name, initial_value, ctx)
        size = math.prod(part.shape)
        count = ctx.total_replicas
        shard = -(-size // count)
        layout = _Layout(size, shard, padding=shard * count - size)
        source = origin.read_value() if origin is not None else initial_value
        # The chief also holds the other nodes' shards, to save and fetch their slots.
        for replica in (range(count) if ctx.is_chief else self._local):
            with tf.device(ctx.tf_device(ctx.replicas[replica])):
                layout.shards[replica] = tf.Variable(layout.piece(source, replica),
                                                     trainable=False,
                                                     name=f"{part.name}/shard_{replica}")
        self._layouts[part.name] = layout
        return PartStorage(part, [copy], [copy] * ctx.num_replicas, self, origin)

    def initialization(self, storage: PartStorage) -> Ownership:
        shards = self._layouts[storage.part.name].shards
        elsewhere = [v for index, v in shards.items() if index not in self._local]
        if storage.origin is None:
            return Ownership(elsewhere=elsewhere)
        return Ownership(chief=[storage.origin],
                         derived=[*storage.copies, *(shards[index] for index in self._local)],
                         elsewhere=elsewhere, start_only=[storage.origin])

    def synchronize(self, members: List[Member]) -> Reduced:
        ctx, out = self.ctx, Reduced()
        buffers = {}  # (group, dtype) -> members, in the members' order
        for member in members:
            key = (member.storage.part.synchronizer.group, member.grads[0].dtype)
            buffers.setdefault(key, []).append(member)
        for (group, dtype), grouped in sorted(buffers.items(), key=lambda item: (
                item[0][0], item[0][1].name)):
            reduce_key = self.keys.take()
            self._gathers.append((grouped, [self.keys.take() for _ in grouped],
                                  self.keys.take()))
            layouts = [self._layouts[m.storage.part.name] for m in grouped]
            for replica, index in enumerate(self._local):
                with tf.device(ctx.replica_tf_device(replica)), \
                        tf.name_scope(f"{replica_scope(replica)}/{grouped[0].storage.part.name}"):
                    flat = tf.concat([tf.reshape(m.grads[replica], [-1]) for m in grouped], 0)
                    mean = tf.raw_ops.CollectiveReduceV2(
                        input=flat, group_size=ctx.total_replicas,
                        group_key=COLLECTIVE_GROUP_KEY, instance_key=reduce_key,
                        ordering_token=[], merge_op="Add", final_op="Id",
                        max_subdivs_per_device=RING_SUBDIVISIONS)
                    pieces = tf.split(mean, [layout.size for layout in layouts])
                    for member, layout, piece in zip(grouped, layouts, pieces):
                        update = member.update(layout.piece(piece, index))
                        out.local_updates.append(dataclasses.replace(
                            update, variable=layout.shards[index],
                            shard=(index * layout.shard, layout.shard)))
            for member, layout in zip(grouped, layouts):
                for index, shard in layout.shards.items():
                    if index not in self._local:
                        with tf.device(shard.device):
                            update = member.update(tf.zeros([layout.shard], dtype))
                        out.foreign_updates.append(dataclasses.replace(
                            update, variable=shard, shard=(index * layout.shard, layout.shard)))
        return out

    def after_local_updates(self, updated: dict) -> list:
        """Gathers the updated shards and writes them into this node's copies."""
        ctx, ops = self.ctx, []
        count = ctx.total_replicas
        # One gather per part, so that each part's shards arrive contiguous: a
        # copy fewer for every byte of the model than one gather per group.
        for grouped, value_keys, order_key in self._gathers:
            layouts = [self._layouts[m.storage.part.name] for m in grouped]
            for replica, index in enumerate(self._local):
                with tf.device(ctx.replica_tf_device(replica)):
                    gathered = []
                    for layout, key in zip(layouts, value_keys):
                        shard = layout.shards[index]
                        with tf.control_dependencies([updated[shard.name]]
                                                     if shard.name in updated else []):
                            gathered.append(_gather(shard.read_value(), count, key))
                    order = _gather(tf.constant([index], tf.int64), count, order_key)
                if replica:
                    ops += [t.op for t in gathered] + [order.op]
                    continue
                with tf.device(ctx.shared_device):
                    # The gathers stack the shards in the collective's own order,
                    # which is the replicas' unless TensorFlow ranked them otherwise.
                    in_order = tf.reduce_all(tf.equal(order, tf.range(count, dtype=tf.int64)))
                    for member, layout, values in zip(grouped, layouts, gathered):
                        ops.append(member.storage.copies[0].assign(
                            _reassembled(values, layout, in_order, order,
                                         member.storage.part.shape), read_value=False))
        return ops

    def initialized_with_part(self, storage: PartStorage) -> list:
        shards = self._layouts[storage.part.name].shards
        return [*super().initialized_with_part(storage), *(shards[i] for i in self._local)]

    def restore_targets(self, storage: PartStorage) -> List[Target]:
        return [Target(storage.copies[0]), *self._shard_targets(storage, lambda s: s)]

    def slot_targets(self, storage: PartStorage, slot_of) -> List[Target]:
        return self._shard_targets(storage, slot_of)

    def slot_value(self, storage: PartStorage, slot_of):
        layout = self._layouts[storage.part.name]
        slots = [slot_of(layout.shards[r]) if r in layout.shards else None
                 for r in range(self.ctx.total_replicas)]
        if any(slot is None for slot in slots):
            return None  # a worker holds its own shards' slots only

        def value(rows=None):
            flat = tf.concat([slot.read_value() for slot in slots], 0)
            whole = tf.reshape(flat[:layout.size], storage.part.shape)
            return whole if rows is None else whole[rows[0]:rows[1]]
        return value

    def _shard_targets(self, storage: PartStorage, variable_of) -> List[Target]:
        layout = self._layouts[storage.part.name]
        targets = []
        for index in self._local:
            variable = variable_of(layout.shards[index])
            if variable is not None:
                targets.append(Target(variable, lambda value, i=index: layout.piece(value, i)))
        return targets


def _reassembled(gathered: tf.Tensor, layout: _Layout, in_order: tf.Tensor, order: tf.Tensor,
                 shape: tuple) -> tf.Tensor:
    """A part's value from its gathered shards (in the collective's ``order``)."""
    rows = tf.reshape(gathered, [-1, layout.shard])
    rows = tf.cond(in_order, lambda: rows,
                   lambda: tf.gather(rows, tf.math.invert_permutation(order)))
    flat = tf.reshape(rows, [-1])
    return tf.reshape(flat[:layout.size] if layout.padding else flat, shape)


def _gather(tensor: tf.Tensor, group_size: int, instance_key: int) -> tf.Tensor:
    return tf.raw_ops.CollectiveGatherV2(
        input=tensor, group_size=group_size, group_key=COLLECTIVE_GROUP_KEY,
        instance_key=instance_key, ordering_token=[])


# --------------------------------------------------------------------------- sampling

@dataclasses.dataclass(frozen=True)
class _Knobs:
    groups: int  # groups per gradient dtype


class _ShardedSampling(KindSampling):
    """The sampler's sharded-update choices: how many groups; buckets of about equal bytes.

    Only dense variables large enough that any cut of them leaves every
    replica a shard.
    """

    def __init__(self, variables: list, resource_spec, constraints):
        self._smallest = len(resource_spec.replica_devices) * constraints.max_partitions
        self._most_groups = most_groups(variables, constraints)

    def allowed(self, var) -> bool:
        return not var.sparse_grad and math.prod(map(int, var.shape)) >= self._smallest

    def draw_knobs(self, rng: random.Random) -> _Knobs:
        return _Knobs(draw_group_count(rng, self._most_groups))

    def configs(self, units: list, knobs: _Knobs, rng: random.Random) -> dict:
        groups, _ = balanced_groups(units, knobs.groups)
        templates = {}
        for group in set(groups.values()):
            templates[group] = common.Node()
            templates[group].ShardedUpdateSynchronizer.group = group
        return {name: templates[group] for name, group in groups.items()}
