"""Parallax: parameter servers for sparse gradients, all-reduce for dense ones."""
from __future__ import annotations

from typing import Optional

from autodist.strategy import common
from autodist.strategy.all_reduce_builders import ARConfig
from autodist.strategy.base import Strategy, StrategyBuilder
from autodist.strategy.ps_builders import PSConfig, sharded_ps_node_configs


class Parallax(StrategyBuilder):
    """Hybrid strategy chosen by gradient type.

    Variables with ``sparse_grad`` (embeddings) go to parameter servers, split
    along axis 0 and byte-balanced exactly as in :class:`PartitionedPS`, since
    a sparse update touches few rows. Dense variables are all-reduced in
    buckets filled in backward order (see :class:`ARConfig`). Variables without
    a gradient are kept whole on the chief's CPU.

    Args:
        chunk_size: the most dense variables per all-reduce bucket; None for no such cap.
        local_proxy_variable: give each replica a local proxy copy of each sparse variable.
        sync: synchronous PS training; False (with ``staleness`` >= 1) for bounded staleness.
        staleness: how many updates old a replica's read of a PS variable may be; needs
            ``sync=False``.
        all_reduce_spec: an ``AllReduceSynchronizer.Spec`` name; None for the
            cluster's default (``all_reduce_builders.default_all_reduce_spec``).
        compressor: an ``AllReduceSynchronizer.Compressor`` name.
        bucket_bytes: the most gradient bytes per all-reduce bucket; None for no such cap.

    Raises:
        ValueError: for a bad cap, ``sync``/``staleness`` pair or enum name.
    """

    def __init__(self, chunk_size: Optional[int] = None, local_proxy_variable: bool = False,
                 sync: bool = True, staleness: int = 0, all_reduce_spec: Optional[str] = None,
                 compressor: str = "NoneCompressor",
                 bucket_bytes: Optional[int] = common.DEFAULT_BUCKET_BYTES):
        self._ar = ARConfig(chunk_size, all_reduce_spec, compressor, bucket_bytes)
        self._ps = PSConfig(local_proxy_variable, sync, staleness)

    def build(self, graph_item, resource_spec) -> Strategy:
        strategy = common.new_strategy(resource_spec)
        variables = list(graph_item.trainable_variables)
        ps_vars = [v for v in variables if v.sparse_grad or not v.has_grad]
        ps_nodes = {}
        if ps_vars:
            ps_nodes = sharded_ps_node_configs(ps_vars, common.ps_device_names(resource_spec),
                                               self._ps, common.num_shards_even)
        groups = self._ar.groups([(v.name, v, v.size_bytes) for v in variables
                                  if v.name not in ps_nodes])
        spec = self._ar.spec(resource_spec)
        for var in variables:
            strategy.node_config.append(ps_nodes[var.name] if var.name in ps_nodes
                                        else self._ar.node(var.name, groups[var.name], spec))
        return strategy
