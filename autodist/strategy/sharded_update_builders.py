"""ShardedUpdateAR: every replica updates its shard of each variable (ZeRO stage 1)."""
from __future__ import annotations

import math
from typing import Optional

from autodist.strategy import common
from autodist.strategy.all_reduce_builders import ARConfig, no_grad_node_config
from autodist.strategy.base import Strategy, StrategyBuilder


class ShardedUpdateAR(StrategyBuilder):
    """Dense-gradient variables updated in shards; the others all-reduced.

    A variable with a dense gradient and at least one element per replica gets
    a ``ShardedUpdateSynchronizer``: each replica keeps the optimizer's slots of
    its own shard only and updates that shard. A sparse gradient, or a variable
    too small to give every replica a shard, falls back to an
    ``AllReduceSynchronizer``, which the strategy records. Each kind's variables
    are bucketed on their own, filled in backward order (see :class:`ARConfig`).

    Args:
        chunk_size: the most variables per bucket; None for no such cap.
        bucket_bytes: the most gradient bytes per bucket; None for no such cap.

    Raises:
        ValueError: for a bad cap.
    """

    def __init__(self, chunk_size: Optional[int] = None,
                 bucket_bytes: Optional[int] = common.DEFAULT_BUCKET_BYTES):
        # Its shards meet in collectives, so its all-reduced variables do too: a
        # step mixing collectives with scatter-gather's sends would be split in two.
        self._ar = ARConfig(chunk_size, "AUTO", bucket_bytes=bucket_bytes)

    def build(self, graph_item, resource_spec) -> Strategy:
        strategy = common.new_strategy(resource_spec)
        replicas = len(strategy.replicas)
        variables = graph_item.trainable_variables
        fallback = {v.name for v in variables
                    if v.sparse_grad or math.prod(map(int, v.shape)) < replicas}
        sharded = self._ar.groups([(v.name, v, v.size_bytes) for v in variables
                                   if v.has_grad and v.name not in fallback])
        all_reduced = self._ar.groups([(v.name, v, v.size_bytes) for v in variables
                                       if v.has_grad and v.name in fallback])
        for var in variables:
            if var.name in sharded:
                node = strategy.node_config.add(var_name=var.name)
                node.ShardedUpdateSynchronizer.group = sharded[var.name]
            elif var.name in all_reduced:
                strategy.node_config.append(self._ar.node(var.name, all_reduced[var.name],
                                                          self._ar.all_reduce_spec))
            else:
                strategy.node_config.append(
                    no_grad_node_config(var, common.ps_device_names(resource_spec)))
        return strategy

    def __repr__(self) -> str:
        return (f"ShardedUpdateAR(chunk_size={self._ar.chunk_size!r}, "
                f"bucket_bytes={self._ar.bucket_bytes!r})")
