"""DistributedSession: runs the user's fetches and feeds on the distributed graph."""
from __future__ import annotations

import tensorflow as tf

from autodist import _tf_compat
from autodist.kernels.transformer import DistributedGraph


class DistributedSession:
    """Takes ``tf.compat.v1.Session.run`` arguments naming the original graph.

    Fetching a trainable variable returns its full synchronized value; fetching an
    op of the model runs it on every replica; a fetched tensor computed per
    replica comes back as the replicas' mean (float scalars, e.g. a loss), their
    concatenation (batch-major tensors) or replica 0's value (anything else).
    Feeds of batched placeholders are split across the local replicas.

    Args:
        distributed: the transformed graph.
        config: the ``tf.compat.v1.ConfigProto`` for the underlying session.
        target: the TensorFlow server to connect to ('' in-process).
    """

    def __init__(self, distributed: DistributedGraph, config=None, target: str = ""):
        self._distributed = distributed
        self._graph = distributed.graph
        self._cache = {}
        item = distributed.item
        self._variable_fetches = {}
        for name, variable in item.variables.items():
            self._variable_fetches[variable.handle.name] = name
            self._variable_fetches[_tf_compat.graph_element_name(variable)] = name
        self._session = tf.compat.v1.Session(target=target, graph=self._graph, config=config)
        self._session.run(distributed.init_op)

    @property
    def graph(self) -> tf.Graph:
        """The distributed graph this session runs."""
        return self._graph

    def run(self, fetches, feed_dict=None, options=None, run_metadata=None):
        """Like ``tf.compat.v1.Session.run``, on the original graph's elements."""
        mapped = tf.nest.map_structure(self._map_fetch, fetches)
        feeds = {}
        for key, value in (feed_dict or {}).items():
            for target in self._map_feed(key):
                feeds[target] = value
        return self._session.run(mapped, feed_dict=feeds, options=options,
                                 run_metadata=run_metadata)

    def close(self) -> None:
        self._session.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _map_fetch(self, fetch):
        name = _element_name(fetch)
        if name not in self._cache:
            with self._graph.as_default():
                self._cache[name] = self._resolve(name)
        return self._cache[name]

    def _resolve(self, name: str):
        distributed, item = self._distributed, self._distributed.item
        if name in self._variable_fetches:
            return distributed.storage[self._variable_fetches[name]].full_value
        op_name = name.split(":")[0]
        if op_name in item.optimizer_call.update_op_names:
            if ":" in name:
                raise ValueError(f"AutoDist cannot fetch '{name}', an output of the "
                                 "optimizer's update; fetch the train op instead.")
            return distributed.train_op
        if op_name in item.initializer_of:
            return distributed.variable_inits[item.initializer_of[op_name]]
        if op_name in item.excluded:
            raise ValueError(f"AutoDist cannot fetch '{name}': it belongs to a variable that "
                             "the strategy recreated; fetch the variable itself.")
        if not item.is_replicated(name):
            return (self._graph.get_tensor_by_name(name) if ":" in name
                    else self._graph.get_operation_by_name(name))
        copies = [distributed.replica_element(name, r)
                  for r in range(distributed.ctx.num_replicas)]
        if ":" not in name:
            return tf.group(*copies)
        return _combine(copies)

    def _map_feed(self, key) -> list:
        name = _element_name(key)
        if self._distributed.item.is_replicated(name):
            return [self._distributed.replica_element(name, r)
                    for r in range(self._distributed.ctx.num_replicas)]
        return [self._graph.get_tensor_by_name(name)]


def _element_name(element) -> str:
    if isinstance(element, str):
        return element
    if isinstance(element, tf.Variable):
        return element.handle.name
    value = getattr(element, "value", None)  # a Keras 3 variable wraps a tf.Variable
    if isinstance(value, tf.Variable):
        return value.handle.name
    return element.name


def _combine(copies: list) -> tf.Tensor:
    first = copies[0]
    if len(copies) == 1:
        return first
    if first.shape.rank == 0 and first.dtype.is_floating:
        return tf.add_n(copies) / float(len(copies))
    if first.shape.rank and first.shape[0] is None:
        return tf.concat(copies, axis=0)
    return first
