"""ShardedUpdateAR: every replica updates its shard of each variable (ZeRO stage 1)."""
from __future__ import annotations

import math

from autodist.strategy import common
from autodist.strategy.all_reduce_builders import ARConfig, no_grad_node_config
from autodist.strategy.base import Strategy, StrategyBuilder


class ShardedUpdateAR(StrategyBuilder):
    """Dense-gradient variables updated in shards; the others all-reduced.

    A variable with a dense gradient and at least one element per replica gets
    a ``ShardedUpdateSynchronizer``: each replica keeps the optimizer's slots of
    its own shard only and updates that shard. A sparse gradient, or a variable
    too small to give every replica a shard, falls back to an
    ``AllReduceSynchronizer``, which the strategy records. Groups are
    ``index // chunk_size`` over the variables of each kind, in variable order.

    Args:
        chunk_size: consecutive variables of one kind merged into one collective group.

    Raises:
        ValueError: if ``chunk_size < 1``.
    """

    def __init__(self, chunk_size: int = 128):
        self._ar = ARConfig(chunk_size)
        self.chunk_size = self._ar.chunk_size

    def build(self, graph_item, resource_spec) -> Strategy:
        strategy = common.new_strategy(resource_spec)
        replicas = len(strategy.replicas)
        sharded = fallback = 0
        for var in graph_item.trainable_variables:
            if not var.has_grad:
                strategy.node_config.append(
                    no_grad_node_config(var, common.ps_device_names(resource_spec)))
            elif var.sparse_grad or math.prod(map(int, var.shape)) < replicas:
                strategy.node_config.append(self._ar.node(var.name, fallback))
                fallback += 1
            else:
                node = strategy.node_config.add(var_name=var.name)
                node.ShardedUpdateSynchronizer.group = common.chunk_group(sharded,
                                                                          self.chunk_size)
                sharded += 1
        return strategy

    def __repr__(self) -> str:
        return f"ShardedUpdateAR(chunk_size={self.chunk_size!r})"
