"""PS synchronizer: one shared copy of a variable part on its reduction destination.

Replicas read it (or a local proxy of it), their gradients are averaged on the
destination (optionally summed per node first on a transfer destination) and the
optimizer updates the shared copy once per step. On a cluster the chief alone
updates the shared copies, then hands every worker a token; a worker waits for
its token before its step ends, so its next step reads the updated values.
"""
from __future__ import annotations

import collections
import dataclasses
import random
from typing import Dict, List, NamedTuple, Tuple

import numpy as np
import tensorflow as tf

from autodist.kernel_context import KernelContext, replica_scope
from autodist.network import DIRECTIONS, ClusterView, seconds
from autodist.resource_spec import DeviceSpec
from autodist.strategy import common
from autodist.strategy.base import StrategyError
from autodist.synchronizers.base import (KindCost, KindSampling, Member, NodeLayout, Ownership,
                                         PartStorage, Reduced, StoredCopies, SynchronizerKind,
                                         Target, draw_share, stash, token_queue)


class PSSynchronizer(SynchronizerKind):
    """The kind of the ``PSSynchronizer`` field: see the module docstring."""

    field = "PSSynchronizer"
    feature_name = "ps"
    remote_ops = True

    # ------------------------------------------------------------ what the search asks

    @classmethod
    def traffic_record(cls, config, info, grad_bytes: float, devices: dict) -> tuple:
        staleness = config.staleness
        return (grad_bytes, devices.setdefault(config.reduction_destination, len(devices)),
                config.local_replication or staleness > 0, staleness,
                config.transfer_destination != "", 0, 0)

    @classmethod
    def cost(cls, parts, index: np.ndarray, cluster: ClusterView, split_step: bool) -> KindCost:
        """``ps_transfer`` and ``ps_part_overhead``; on a cluster ``ps_serving_nodes``.

        A part is charged the overhead, its share of the binding resources and
        its share of its server's serving cost.
        """
        has_grad = parts.has_grad[index]
        features = {"ps_part_overhead": float(np.count_nonzero(has_grad))}
        transfer, share, binding = _transfer(parts, index, cluster, split_step)
        if transfer:
            features["ps_transfer"] = transfer
        charges = [(index, [("ps_part_overhead", 1.0, has_grad),
                            ("ps_transfer", share, share != 0)])]
        if cluster.multi_node:
            # Each node serving parts with a gradient costs a fixed time per step,
            # shared evenly by its parts (docs/notes/auto_strategy.md).
            served = index[has_grad]
            per_server = np.bincount(parts.server[served], minlength=len(parts.servers))
            features["ps_serving_nodes"] = float(np.count_nonzero(per_server))
            charges.append((served, [("ps_serving_nodes",
                                      1.0 / per_server[parts.server[served]], True)]))
        return KindCost(features, charges, binding)

    @classmethod
    def update_shares(cls, parts, index: np.ndarray, nodes: List[str], server_node: np.ndarray,
                      cluster: ClusterView) -> np.ndarray:
        """The optimizer runs where the shared copy lives: on its server alone."""
        return (server_node == np.arange(len(nodes))[:, None]).astype(np.float64)

    @classmethod
    def link_gbps(cls, parts, index: np.ndarray, cluster: ClusterView) -> np.ndarray:
        ring = cluster.ring_gbps()
        return np.array([cluster.nic_gbps.get(server, ring)
                         for server in parts.servers])[parts.server[index]]

    @classmethod
    def traffic_keys(cls, parts, index: np.ndarray) -> np.ndarray:
        return parts.server[index]

    @classmethod
    def sampling(cls, variables: list, resource_spec, constraints) -> KindSampling:
        return _PSSampling(variables, resource_spec, constraints)

    # ------------------------------------------------------------ the graph

    @classmethod
    def check(cls, config, var_name: str, devices: set, strategy_id: str) -> None:
        for field in ("reduction_destination", "transfer_destination"):
            device = getattr(config, field)
            if (device or field == "reduction_destination") and device not in devices:
                raise StrategyError(
                    f"Strategy {strategy_id}: '{var_name}' has {field} '{device}', "
                    f"which is not a device of the resource spec ({sorted(devices)}).")
        if config.staleness < 0:
            raise StrategyError(f"Strategy {strategy_id}: '{var_name}' has staleness "
                                f"{config.staleness}; it must be 0 or more.")
        if config.sync and config.staleness:
            raise StrategyError(f"Strategy {strategy_id}: '{var_name}' has sync true and "
                                f"staleness {config.staleness}; bounded staleness needs sync "
                                "false.")
        if not config.sync and not config.staleness:
            raise StrategyError(f"Strategy {strategy_id}: '{var_name}' has sync false (or "
                                "unset) and staleness 0, which asks for unbounded asynchrony; "
                                "it is not built. Set sync true for synchronous training, or a "
                                "staleness of 1 or more.")

    @classmethod
    def stored_copies(cls, config, layout: NodeLayout) -> Dict[str, StoredCopies]:
        """The shared copy and its slots on a CPU server; with proxies (see
        :func:`create_ps_storage`), one more copy per CPU replica of every node."""
        server = DeviceSpec.from_string(config.reduction_destination)
        copies = {server.host_address: StoredCopies(1, 1)} if server.device_type == "CPU" else {}
        if _has_proxies(config, layout.split_step):
            for node, replicas in layout.cpu_replicas.items():
                values, slots = copies.get(node, (0, 0))
                copies[node] = StoredCopies(values + replicas, slots)
        return copies

    def __init__(self, ctx: KernelContext, keys):
        super().__init__(ctx, keys)
        self._staleness = 0      # the largest bound among the parts
        self._proxy_parts = []   # parts the replicas read through proxies
        self._sent = False       # gradients are sent to other nodes
        # Proxied part name -> the rows its update writes (this node applies it),
        # or None (another node does); for the parts refreshed by those rows.
        self._updated_rows = {}

    def create_storage(self, part, initial_value: tf.Tensor) -> PartStorage:
        shared, readers = create_ps_storage(part.name, initial_value, part.synchronizer, self.ctx)
        return PartStorage(part, [shared], readers, self)

    def value_device(self, part) -> str:
        return self.ctx.tf_device(part.synchronizer.reduction_destination)

    def initialization(self, storage: PartStorage) -> Ownership:
        shared = storage.copies[0]
        # A cluster's proxies start from the shared value, once the chief has set it.
        derived = ([r for r in storage.readers if r is not shared] if self.ctx.multi_node
                   else [])
        return Ownership(chief=[shared], derived=derived)

    def synchronize(self, members: List[Member]) -> Reduced:
        ctx, out = self.ctx, Reduced()
        for member in members:
            part, sync = member.storage.part, member.storage.part.synchronizer
            self._staleness = max(self._staleness, sync.staleness)
            proxied = member.storage.readers[0] is not member.storage.copies[0]
            if proxied:
                self._proxy_parts.append(member.storage)
            by_rows = proxied and member.updates_rows and not sync.staleness
            if not ctx.multi_node:
                mean = reduce_ps_gradients(member.node_contributions(), sync, ctx)
                if by_rows:
                    self._updated_rows[part.name] = mean.indices
                out.remote_updates.append(member.update(mean))
                continue
            contribution = node_contribution(member, sync, ctx)
            if ctx.split_step:
                store, contribution = stash(part.name, contribution, ctx)
                out.local_ops.append(store)
            sent, mean = accumulate_across_nodes(part.name, contribution, part.shape, sync, ctx)
            out.remote_ops.append(sent)
            if by_rows:
                self._updated_rows[part.name] = None if mean is None else mean.indices
            if mean is not None:
                out.remote_updates.append(member.update(mean))
        self._sent = self._sent or bool(out.remote_ops)
        return out

    def chief_init_ops(self) -> list:
        """Bounded staleness across nodes: workers may run ``staleness`` steps ahead,
        and read each part at most its own staleness bound behind."""
        ctx = self.ctx
        if not (ctx.is_chief and ctx.multi_node):
            return []
        workers = range(1, ctx.num_nodes)
        queues = [(token_queue(w, ctx), self._staleness) for w in workers if self._staleness]
        queues += [(_part_token_queue(p, w, ctx), p.part.synchronizer.staleness)
                   for p in self._proxy_parts if p.part.synchronizer.staleness for w in workers]
        return [queue.enqueue_many([tf.zeros([staleness], tf.int64)])
                for queue, staleness in queues]

    def end_step(self, steps: list, updated: dict) -> list:
        """After ``steps``: the chief's tokens to the workers (or a worker's wait), proxy refresh.

        Each proxy is refreshed as soon as its own part is updated (a worker learns
        of it through a token of that part): on a cluster, pulls of the parts
        updated first then overlap the pushes of the others.
        """
        ctx = self.ctx
        if ctx.multi_node and (self._sent or self._proxy_parts):
            with tf.control_dependencies(steps):
                if ctx.is_chief:
                    steps = [token_queue(w, ctx).enqueue(tf.constant(0, tf.int64))
                             for w in range(1, ctx.num_nodes)]
                else:
                    steps = [token_queue(ctx.node_index, ctx).dequeue()]
        if not self._proxy_parts:
            return steps
        with tf.device(ctx.shared_device):
            counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="autodist_step")
            step = counter.assign_add(1)
        refreshes, told = [], []
        for part in self._proxy_parts:
            if part.part.name in self._updated_rows:
                refresh, tell = self._refresh_rows(part, updated)
                refreshes.append(refresh)
                told += tell
                continue
            shared = part.copies[0]
            if shared.name in updated:  # this node updates the part, and tells the workers
                gate = [updated[shared.name]]
                with tf.control_dependencies(gate):
                    told += [_part_token_queue(part, w, ctx).enqueue(tf.constant(0, tf.int64))
                             for w in range(1, ctx.num_nodes)]
            else:
                gate = [_part_token_queue(part, ctx.node_index, ctx).dequeue()]
            with tf.control_dependencies(gate):
                refreshes.append(refresh_proxies(shared, part.readers,
                                                 part.part.synchronizer.staleness, step))
        return [*steps, *told, *refreshes]

    def _refresh_rows(self, part: PartStorage, updated: dict) -> tuple:
        """Refreshes a part's proxies by the rows its update wrote (``Member.updates_rows``).

        The node applying the update knows the rows (the mean gradient's) and
        sends them to every other node in place of the part's token; each node
        then reads those rows of the part, where it is stored, into its proxies.

        Returns:
            (the refresh, the sends to the other nodes)
        """
        shared, ctx = part.copies[0], self.ctx
        rows = self._updated_rows[part.part.name]
        tell = []
        if rows is not None:
            with tf.device(shared.device), tf.control_dependencies([updated[shared.name]]):
                rows, _ = tf.unique(tf.cast(rows, tf.int64))
                tell = [_part_rows_queue(part, w, ctx).enqueue(rows)
                        for w in range(1, ctx.num_nodes)]
        else:
            rows = tf.ensure_shape(_part_rows_queue(part, ctx.node_index, ctx).dequeue(), [None])
        with tf.device(shared.device):
            values = shared.sparse_read(rows)
        return tf.group(*[proxy.scatter_update(tf.IndexedSlices(values, rows))
                          for proxy in part.readers]), tell

    def restore_targets(self, storage: PartStorage) -> List[Target]:
        targets = super().restore_targets(storage)
        if self.ctx.is_chief:
            return targets
        # The shared copy is the chief's to restore.
        return [t for t in targets if t.variable is not storage.copies[0]]


# --------------------------------------------------------------------------- costs
# Traffic rules for a PS part on node ``D``, each replica's gradient ``g`` bytes
# (the part's bytes, or for a sparse gradient the rows it touches) and the
# part's value ``v`` bytes:
#
# * push: each replica on another node sends ``g`` to ``D``. With a
#   ``transfer_destination``, or when a multi-node step is split because the
#   strategy mixes PS and AllReduce (README), a node sums its replicas' gradients
#   first and sends one dense ``g``; sparse sums concatenate rows, so they do not
#   shrink.
# * pull: each remote replica reads ``v``; a sparse-gradient variable that
#   the model only gathers rows of (``VariableInfo.read_whole`` false) is read
#   by gathers on the servers of its parts, so only the touched rows travel.
#   With a local proxy (``local_replication``, a staleness bound or a split
#   step) each remote node copies the whole part once: one read feeds all the
#   node's proxies, and TensorFlow's master cuts a graph by worker, not by
#   device, so the value crosses the network once per node. A proxy of a part
#   whose update writes only its gradient's rows (``updates_rows``, no
#   staleness bound) copies those rows: every replica's touched rows, at most
#   the part.
# * staleness ``s`` refreshes proxies every ``s + 1`` steps, so pulls are divided
#   by ``s + 1``; pushes are not, since every gradient is still applied.
# * replicas on ``D`` itself load ``D``'s local bus instead of its NIC.
#
# When those bytes move in a step is given by PHASES.

PHASES = ("push", "refresh", "read")
"""How PS bytes move in a synchronous step: gradients are pushed to the
servers; a proxy is refreshed as soon as its own part is updated, so refreshes
overlap the pushes of the parts still arriving; replicas without a proxy read
the servers in the next step's forward pass, after every update."""
_PUSH, _REFRESH, _READ = range(len(PHASES))
_IN, _OUT, _LOCAL = (DIRECTIONS.index(d) for d in ("in", "out", "local"))


class PSFlows(NamedTuple):
    """How PS parts' bytes move each step, one entry per part; loads are linear in push and read."""

    server: np.ndarray     # index into the parts' servers
    push_once: np.ndarray  # a node sends one summed gradient, not one per replica
    proxy: np.ndarray      # a node pulls one copy for all its replicas
    push: np.ndarray       # one replica's gradient bytes
    read: np.ndarray       # bytes one read moves, already divided by the refresh period


def ps_flows(parts, index: np.ndarray, split_step: bool, num_replicas: int) -> PSFlows:
    """Applies the traffic rules above to the PS parts ``index`` of ``parts`` (``SyncParts``)."""
    proxy = parts.proxy[index] | split_step
    sparse = parts.sparse[index]
    grad_bytes, value_bytes = parts.grad_bytes[index], parts.value_bytes[index]
    by_rows = sparse & parts.updates_rows[index] & (parts.staleness[index] == 0)
    read = np.where(sparse & ~proxy & ~parts.read_whole[index], grad_bytes,
                    np.where(proxy & by_rows, np.minimum(value_bytes, grad_bytes * num_replicas),
                             value_bytes))
    return PSFlows(parts.server[index], (parts.aggregate[index] | split_step) & ~sparse, proxy,
                   np.where(parts.has_grad[index], grad_bytes, 0.0),
                   read / (parts.staleness[index] + 1))


def ps_loads(flows: PSFlows, servers: List[str],
             cluster: ClusterView) -> Tuple[List[str], np.ndarray]:
    """The bytes each flow puts on every resource per step.

    Args:
        flows: from :func:`ps_flows`.
        servers: the node addresses ``flows.server`` indexes.
        cluster: the replicas per node.

    Returns:
        tuple: (the nodes: the replicas' first, then other servers; the bytes,
        ``[phase (PHASES), node, direction (DIRECTIONS), flow]``).
    """
    nodes, server_node = cluster.step_nodes(servers)
    server = server_node[flows.server]
    flow = np.arange(len(server))
    loads = np.zeros((len(PHASES), len(nodes), len(DIRECTIONS), len(server)))
    push, pull = loads[_PUSH], np.zeros_like(loads[_PUSH])
    for node, count in enumerate(cluster.replicas_per_node.values()):
        here = server == node
        reads = np.where(flows.proxy, flows.read, count * flows.read)
        push[node, _LOCAL] += np.where(here, count * flows.push, 0.0)
        pull[node, _LOCAL] += np.where(here, reads, 0.0)
        sent = np.where(here, 0.0, np.where(flows.push_once, flows.push, count * flows.push))
        reads = np.where(here, 0.0, reads)
        push[node, _OUT] += sent
        push[server, _IN, flow] += sent
        pull[server, _OUT, flow] += reads
        pull[node, _IN] += reads
    loads[_REFRESH] = np.where(flows.proxy, pull, 0.0)
    loads[_READ] = np.where(flows.proxy, 0.0, pull)
    return nodes, loads


def _busiest(per_flow: np.ndarray) -> Tuple[float, int, int]:
    """(seconds, node, direction) of the busiest resource of ``[node, direction, flow]`` times."""
    per_resource = per_flow.sum(axis=2)
    node, direction = np.unravel_index(np.argmax(per_resource), per_resource.shape)
    return float(per_resource[node, direction]), int(node), int(direction)


def _transfer(parts, index: np.ndarray, cluster: ClusterView, split_step: bool) -> tuple:
    """(``ps_transfer`` seconds, each part's share of it, the binding resources or None).

    Refreshes overlap the pushes, but a part's refresh follows its own push.
    Each server's pushes arrive together, so its largest refresh comes last: the
    busiest resource of pushes and refreshes binds, or else that of the pushes,
    then those last refreshes. Direct reads come after every update and add up.
    """
    flows = ps_flows(parts, index, split_step, cluster.num_replicas)
    nodes, loads = ps_loads(flows, parts.servers, cluster)
    rates = np.array([[cluster.gbps((node, direction)) for direction in DIRECTIONS]
                      for node in nodes])
    push, refresh, read = (seconds(phase, rates[:, :, None]) for phase in loads)
    transfer, share, bindings = 0.0, 0.0, []
    refresh_times = refresh.max(axis=(0, 1))  # each part's, on its busiest resource
    last = np.zeros(len(index), dtype=bool)
    for server in np.unique(flows.server[refresh_times > 0]):
        on_server = np.flatnonzero(flows.server == server)
        last[on_server[np.argmax(refresh_times[on_server])]] = True
    overlapped, node, direction = _busiest(push + refresh)
    after_pushes, push_node, push_direction = _busiest(push)
    tail, tail_node, tail_direction = _busiest(np.where(last, refresh, 0.0))
    if after_pushes + tail > overlapped:
        transfer = after_pushes + tail
        share = push[push_node, push_direction] + refresh[tail_node, tail_direction] * last
        bindings.append(f"{nodes[push_node]} {DIRECTIONS[push_direction]} (push), "
                        f"{nodes[tail_node]} {DIRECTIONS[tail_direction]} (last refreshes)")
    elif overlapped:
        transfer = overlapped
        share = (push + refresh)[node, direction]
        phases = "push, refresh" if last.any() else "push"
        bindings.append(f"{nodes[node]} {DIRECTIONS[direction]} ({phases})")
    reading, node, direction = _busiest(read)
    if reading:
        transfer += reading
        share = share + read[node, direction]
        bindings.append(f"{nodes[node]} {DIRECTIONS[direction]} (read)")
    return transfer, np.broadcast_to(share, index.shape), ", ".join(bindings) or None


@dataclasses.dataclass(frozen=True)
class _Knobs:
    servers: tuple            # the PS devices that serve, the chief's first
    dense_proxy_share: float
    sparse_proxy_share: float
    aggregate_share: float
    staleness: int


class _PSSampling(KindSampling):
    """The sampler's PS choices: servers, proxies, node sums, staleness; balanced placement."""

    def __init__(self, variables: list, resource_spec, constraints):
        self._devices = common.ps_device_names(resource_spec)
        self._max_staleness = constraints.max_staleness
        self._pinned_bytes = sum(v.size_bytes for v in variables if not v.has_grad)
        # Summing a node's replicas first only changes something on a cluster with
        # a node of several replicas.
        per_node = collections.Counter(d.host_address for d in resource_spec.replica_devices)
        self._can_aggregate = len(per_node) > 1 and max(per_node.values()) > 1
        # Node configs are copied from templates: protobuf field setters cost more
        # than one CopyFrom.
        self._templates = {}

    def draw_knobs(self, rng: random.Random) -> _Knobs:
        chosen = set(rng.sample(self._devices, rng.randint(1, len(self._devices))))
        return _Knobs(servers=tuple(d for d in self._devices if d in chosen),
                      dense_proxy_share=draw_share(rng), sparse_proxy_share=draw_share(rng),
                      aggregate_share=draw_share(rng) if self._can_aggregate else 0.0,
                      staleness=(rng.randint(0, self._max_staleness) if self._max_staleness
                                 else 0))

    def plan(self, var, knobs: _Knobs, rng: random.Random) -> Tuple[bool, bool]:
        """(a local proxy, nodes sum their replicas' gradients first)."""
        proxy = rng.random() < (knobs.sparse_proxy_share if var.sparse_grad
                                else knobs.dense_proxy_share)
        return proxy, rng.random() < knobs.aggregate_share

    def configs(self, units: list, knobs: _Knobs, rng: random.Random) -> dict:
        items = [(name, size) for _, plan in units for name, size in zip(plan.names, plan.sizes)]
        # Variables without a gradient sit on the chief's CPU: count them when it serves.
        pinned = ({self._devices[0]: self._pinned_bytes}
                  if self._devices[0] in knobs.servers else None)
        placement = common.balanced_placement(items, knobs.servers, pinned)[0]
        return {name: self._template(placement[name], *plan.choices, knobs.staleness)
                for _, plan in units for name in plan.names}

    def _template(self, device: str, proxy: bool, aggregate: bool, staleness: int):
        key = (device, proxy, aggregate, staleness)
        if key not in self._templates:
            # On a cluster any transfer_destination makes every node sum its own replicas.
            self._templates[key] = common.ps_node_config(
                "", device, proxy, sync=staleness == 0, staleness=staleness,
                transfer_destination=device if aggregate else "")
        return self._templates[key]

def _part_token_queue(part: PartStorage, worker: int, ctx: KernelContext) -> tf.queue.FIFOQueue:
    """The queue telling worker ``worker`` that ``part`` is updated, beside the part.

    On the part's own device, a worker's wait and its read of the new value run
    there together, without a round trip of their own.
    """
    return token_queue(worker, ctx, f"updated_{part.part.name}",
                       device=ctx.tf_device(part.part.synchronizer.reduction_destination))


def _part_rows_queue(part: PartStorage, worker: int, ctx: KernelContext) -> tf.queue.FIFOQueue:
    """The queue telling worker ``worker`` which rows of ``part`` an update wrote, beside the part."""
    return token_queue(worker, ctx, f"updated_rows_{part.part.name}",
                       device=ctx.tf_device(part.part.synchronizer.reduction_destination),
                       vectors=True)


def create_ps_storage(name: str, initial_value: tf.Tensor, sync, ctx: KernelContext):
    """Creates the shared variable and, when asked for, the replicas' proxies.

    Proxies exist with ``local_replication``, a staleness bound, or when the step
    is split (a collective step may only read local copies): replicas then read a
    local copy that is refreshed after updates, not the shared one. On a cluster
    a proxy starts from the shared value (the chief's initial value).

    Returns:
        (shared variable, list of what each replica reads)
    """
    with tf.device(ctx.tf_device(sync.reduction_destination)):
        shared = tf.Variable(initial_value, name=name)
    if not _has_proxies(sync, ctx.split_step):
        return shared, [shared] * ctx.num_replicas
    start = shared.read_value() if ctx.multi_node else initial_value
    proxies = []
    for replica in range(ctx.num_replicas):
        with tf.device(ctx.replica_tf_device(replica)):
            proxies.append(tf.Variable(start, trainable=False,
                                       name=f"{replica_scope(replica)}/{name}/proxy"))
    return shared, proxies


def _has_proxies(sync, split_step: bool) -> bool:
    return bool(sync.local_replication or sync.staleness > 0 or split_step)


def reduce_ps_gradients(grads: list, sync, ctx: KernelContext):
    """Adds the replicas' contributions to one part's gradient up on its destination
    (or, where they come summed per node already, adds the nodes' sums there).

    Args:
        grads: this node's contributions, dense tensors or IndexedSlices: one per
            replica, or their sum (``Member.node_contributions``).
        sync: the part's PSSynchronizer.

    Returns:
        the mean gradient, dense or IndexedSlices like the inputs.
    """
    if sync.transfer_destination:
        with tf.device(ctx.tf_device(sync.transfer_destination)):
            grads = [_sum(grads)]
    with tf.device(ctx.tf_device(sync.reduction_destination)):
        return _sum(grads)


def _sum(grads: list):
    if len(grads) == 1:
        return grads[0]
    if isinstance(grads[0], tf.IndexedSlices):
        # Duplicate rows stay; the optimizers sum duplicate indices themselves.
        return tf.IndexedSlices(tf.concat([g.values for g in grads], 0),
                                tf.concat([tf.cast(g.indices, tf.int64) for g in grads], 0),
                                grads[0].dense_shape)
    return tf.add_n(grads)


def refresh_proxies(shared: tf.Variable, proxies: list, staleness: int,
                    step: tf.Tensor) -> tf.Operation:
    """Copies the shared value to the proxies; with staleness s, every s + 1 steps."""
    def copy():
        value = shared.read_value()
        return tf.group(*[p.assign(value) for p in proxies])
    if staleness == 0:
        return copy()
    return tf.cond(tf.equal(step % (staleness + 1), 0), lambda: tf.group(copy()), tf.no_op)


# Applications are never dropped as stale: the token queues below keep nodes in step.
_ALWAYS_FRESH = 2 ** 62


def node_contribution(member: Member, sync, ctx: KernelContext):
    """This node's share of a part's gradient: the sum of its replicas' contributions.

    The shares of all nodes add up to the mean gradient. With a
    ``transfer_destination``, or in a split step, the node sums its replicas'
    gradients on its own CPU (as one product where ``member.node_contributions``
    gives one) and pushes one tensor; otherwise the sum happens on the
    destination, so every replica's gradient crosses the network.
    """
    if sync.transfer_destination or ctx.split_step:
        device, contributions = ctx.shared_device, member.node_contributions()
    else:
        device, contributions = ctx.tf_device(sync.reduction_destination), member.grads
    with tf.device(device):
        return _sum(contributions)


def accumulate_across_nodes(name: str, contribution, shape: tuple, sync,
                            ctx: KernelContext):
    """Sends this node's contribution to the part's accumulator on its destination.

    Returns:
        (apply op, on the chief the sum of all nodes' contributions, else None)
    """
    if isinstance(contribution, tf.IndexedSlices):
        return _gather_across_nodes(name, contribution, shape, sync, ctx)
    with tf.device(ctx.tf_device(sync.reduction_destination)):
        # SUM: the contributions are already scaled to add up to the mean.
        accumulator = tf.compat.v1.ConditionalAccumulator(
            contribution.dtype, shape=shape, shared_name=f"{name}/accumulator",
            name=f"{name}/accumulator", reduction_type="SUM")
        apply = accumulator.apply_grad(contribution, local_step=_ALWAYS_FRESH)
        if not ctx.is_chief:
            return apply, None
        with tf.control_dependencies([apply]):
            mean = accumulator.take_grad(ctx.num_nodes)
    return apply, mean


def _gather_across_nodes(name: str, contribution: tf.IndexedSlices, shape: tuple, sync,
                         ctx: KernelContext):
    """A sparse part's contributions, concatenated in node order on the chief.

    Every node queues its rows on the destination, one queue per node; the chief
    takes one item from each, in node order. Duplicate rows stay as they are, in
    the order one device would see them: an optimizer that squares a sparse
    gradient's rows (Keras's Adam) must see the same rows as on one device.
    """
    def queue(node):
        return tf.queue.FIFOQueue(capacity=-1, dtypes=[contribution.dtype, tf.int64],
                                  shared_name=f"{name}/sparse_from_{node}",
                                  name=f"{name}/sparse_from_{node}")

    with tf.device(ctx.tf_device(sync.reduction_destination)):
        apply = queue(ctx.node_index).enqueue(
            [contribution.values, tf.cast(contribution.indices, tf.int64)])
        if not ctx.is_chief:
            return apply, None
        with tf.control_dependencies([apply]):
            pieces = [queue(node).dequeue() for node in range(ctx.num_nodes)]
        row_shape = tf.TensorShape(shape[1:])
        values = [tf.ensure_shape(v, tf.TensorShape([None]).concatenate(row_shape))
                  for v, _ in pieces]
        indices = [tf.ensure_shape(i, [None]) for _, i in pieces]
        mean = tf.IndexedSlices(tf.concat(values, 0), tf.concat(indices, 0),
                                tf.constant(shape, tf.int64))
    return apply, mean
