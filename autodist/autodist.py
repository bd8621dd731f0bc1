"""AutoDist: the user's entry point, coordinating spec -> strategy -> graph -> session."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional, Union

import tensorflow as tf

from autodist import _tf_compat
from autodist.graph_item import GraphItem
from autodist.kernels.context import KernelContext
from autodist.kernels.transformer import transform
from autodist.resource_spec import ResourceSpec
from autodist.session import DistributedSession
from autodist.strategy.base import Strategy, StrategyBuilder
from autodist.strategy.compiler import compile_strategy

THREADS_ENV = ("AUTODIST_INTRA_OP_THREADS", "AUTODIST_INTER_OP_THREADS")


class AutoDist:
    """Distributes a single-device TensorFlow model per a strategy.

    Example:
        ad = AutoDist(resource_spec_file="configs/local_2cpu.yml", strategy_builder=PS())
        with tf.Graph().as_default(), ad.scope():
            ...  # the single-device model and a tf.compat.v1.train optimizer
            sess = ad.create_distributed_session()

    Note:
        The model, including the optimizer's ``minimize``/``apply_gradients``, must
        be built inside ``ad.scope()``, and the session created there too.

    Args:
        resource_spec_file: path of the cluster's YAML resource spec.
        strategy_builder: a builder (``PS()``, ``AllReduce()``, ...) or a saved
            ``Strategy`` to reuse.

    Raises:
        ResourceSpecError: when the spec is missing or invalid.
        TypeError: when ``strategy_builder`` is neither a builder nor a Strategy.
    """

    def __init__(self, resource_spec_file: str,
                 strategy_builder: Union[StrategyBuilder, Strategy]):
        self._resource_spec = ResourceSpec(resource_spec_file)
        if not isinstance(strategy_builder, (StrategyBuilder, Strategy)):
            raise TypeError(
                f"AutoDist: strategy_builder must be a StrategyBuilder such as PS() or a "
                f"Strategy from Strategy.load(), not {type(strategy_builder).__name__}.")
        self._builder = strategy_builder
        self._optimizer_calls = []
        self._strategy: Optional[Strategy] = None

    @property
    def resource_spec(self) -> ResourceSpec:
        return self._resource_spec

    @property
    def strategy(self) -> Optional[Strategy]:
        """The strategy in use, once ``create_distributed_session`` has run."""
        return self._strategy

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Build the model in here; AutoDist records what the optimizer applies."""
        with _tf_compat.capture_apply_gradients(self._optimizer_calls.append):
            yield

    def create_distributed_session(self, config: Optional[tf.compat.v1.ConfigProto] = None
                                   ) -> DistributedSession:
        """Builds (or reuses) the strategy, rewrites the default graph and opens a session.

        Args:
            config: optional session config merged over AutoDist's.

        Returns:
            DistributedSession taking the arguments of ``tf.compat.v1.Session.run``.
        """
        graph = tf.compat.v1.get_default_graph()
        calls = [c for c in self._optimizer_calls if c.result_op_name in
                 {op.name for op in graph.get_operations()}]
        if len(calls) > 1:
            raise NotImplementedError(
                f"AutoDist supports one optimizer update per graph; the graph has {len(calls)} "
                "(apply_gradients was called more than once).")
        item = GraphItem(graph, calls[0] if calls else None)
        strategy = (self._builder if isinstance(self._builder, Strategy)
                    else self._builder.build(item, self._resource_spec))
        compiled = compile_strategy(strategy, item, self._resource_spec)
        ctx = self._local_context(strategy)
        distributed = transform(item, compiled, ctx)
        self._strategy = strategy
        return DistributedSession(distributed, config=self._session_config(config))

    def _local_context(self, strategy: Strategy) -> KernelContext:
        spec = self._resource_spec
        if len(spec.nodes) > 1:
            raise NotImplementedError("AutoDist runs on one node for now; the resource spec "
                                      f"'{spec.source}' has {len(spec.nodes)}.")
        devices = spec.cpu_devices + spec.replica_devices
        tf_devices = {d.name_string(): f"/device:{d.device_type}:{d.device_index}"
                      for d in devices}
        return KernelContext(replica_devices=tuple(strategy.replicas), tf_devices=tf_devices,
                             shared_device=tf_devices[spec.ps_devices[0].name_string()])

    def _session_config(self, user_config) -> tf.compat.v1.ConfigProto:
        cpus = max(d.device_index for d in self._resource_spec.cpu_devices) + 1
        config = tf.compat.v1.ConfigProto(device_count={"CPU": cpus}, allow_soft_placement=True)
        intra, inter = (os.environ.get(name) for name in THREADS_ENV)
        if intra:
            config.intra_op_parallelism_threads = int(intra)
        if inter:
            config.inter_op_parallelism_threads = int(inter)
        if user_config is not None:
            config.MergeFrom(user_config)
        return config
