"""SavedModelBuilder: exports the single-device graph with the trained values, for serving."""
from __future__ import annotations

import os
import tempfile
from typing import Optional

import tensorflow as tf

from autodist.checkpoint.saver import Saver
from autodist.checkpoint.single_device import single_device_copy
from autodist.session import DistributedSession


class SavedModelBuilder:
    """``tf.compat.v1.saved_model.Builder`` for AutoDist sessions.

    The SavedModel holds the user's original graph (no replicas, partitions or
    synchronization) and the trained values, loadable with
    ``tf.compat.v1.saved_model.load``. On a cluster only the chief writes it.

    Args:
        export_dir: where to write; must not exist yet.
    """

    def __init__(self, export_dir: str):
        self._export_dir = export_dir
        self._builder: Optional[tf.compat.v1.saved_model.Builder] = None
        self._is_chief = True

    def add_meta_graph_and_variables(self, sess: DistributedSession, tags: list,
                                     signature_def_map: Optional[dict] = None,
                                     main_op: Optional[tf.Operation] = None,
                                     strip_default_attrs: bool = False) -> None:
        """Adds the single-device graph and the session's current values.

        Args:
            sess: the AutoDist session.
            tags: the meta graph's tags, e.g. ``[tf.saved_model.SERVING]``.
            signature_def_map: signatures built from the original graph's tensors.
            main_op: an op of the original graph to run on load.
            strip_default_attrs: drop attributes that have their default values.
        """
        if not isinstance(sess, DistributedSession):
            raise TypeError(f"autodist.checkpoint.SavedModelBuilder needs the session of "
                            f"ad.create_distributed_session(), not a {type(sess).__name__}.")
        self._is_chief = sess.distributed.ctx.is_chief
        if not self._is_chief:
            return
        original = sess.distributed.item.graph
        with original.as_default():
            saver = Saver()
        with tempfile.TemporaryDirectory() as scratch:
            values = saver.save(sess, os.path.join(scratch, "values"), write_meta_graph=False,
                                write_state=False)
            copy, plain_saver = single_device_copy(original, saver.names)
            with tf.compat.v1.Session(graph=copy) as plain:
                plain_saver.restore(plain, values)
                if self._builder is None:
                    self._builder = tf.compat.v1.saved_model.Builder(self._export_dir)
                self._builder.add_meta_graph_and_variables(
                    plain, tags, signature_def_map=signature_def_map,
                    main_op=copy.as_graph_element(main_op.name) if main_op is not None else None,
                    strip_default_attrs=strip_default_attrs, saver=plain_saver)

    def save(self, as_text: bool = False) -> Optional[bytes]:
        """Writes the SavedModel; returns its path (None on nodes other than the chief)."""
        if not self._is_chief:
            return None
        if self._builder is None:
            raise ValueError("autodist.checkpoint.SavedModelBuilder.save: call "
                             "add_meta_graph_and_variables first.")
        return self._builder.save(as_text)
