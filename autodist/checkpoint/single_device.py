"""A plain copy of the user's single-device graph, for files that must not show AutoDist."""
from __future__ import annotations

from typing import Dict, Tuple

import tensorflow as tf


def single_device_copy(graph: tf.Graph, names: Dict[str, str]
                       ) -> Tuple[tf.Graph, tf.compat.v1.train.Saver]:
    """Copies ``graph`` (devices cleared) and builds a plain saver in the copy.

    The user's graph stays untouched: AutoDist may still be running it.

    Args:
        graph: the user's single-device graph.
        names: checkpoint name -> name of the variable's op in ``graph``.

    Returns:
        (the copy, a ``tf.compat.v1.train.Saver`` of those variables in it)
    """
    meta_graph = tf.compat.v1.train.export_meta_graph(graph=graph, clear_devices=True)
    copy = tf.Graph()
    with copy.as_default():
        tf.compat.v1.train.import_meta_graph(meta_graph)
        variables = {v.op.name: v for v in
                     tf.compat.v1.global_variables() + tf.compat.v1.local_variables()}
        saver = tf.compat.v1.train.Saver({key: variables[name] for key, name in names.items()})
    return copy, saver
