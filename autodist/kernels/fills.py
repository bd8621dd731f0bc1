"""Large fills stay fills: Grappler must not turn them into constants a session keeps.

Grappler's constant folding replaces a ``Fill`` with constant inputs (``tf.zeros``,
``tf.ones`` of a static shape) by a ``Const``: its encoding is a single repeated
value and passes the folding's size bound whatever the fill's size, but the
kernel holding it expands it into the whole tensor for the session's life. A
variable started from it shares that buffer until its first write, which then
copies it: every zero-started variable (an optimizer's slots, a stitched copy,
a gradient accumulator, a zero-initialized table) cost its size once more.
Grappler does not fold through a ``PlaceholderWithDefault``, so a large fill's
value is passed through one: the fill runs when its consumer does (at
initialization) and its bytes go when that is done.
"""
from __future__ import annotations

import tensorflow as tf

from autodist import _tf_compat

# Smaller fills may be folded: what a session keeps of them is small, and a fill in
# the step (a gradient's ones) is then not recomputed at every run.
KEPT_FILL_BYTES = 1 << 20


def keep_large_fills(graph: tf.Graph) -> int:
    """Passes the value of every ``Fill`` of ``KEPT_FILL_BYTES`` or more through a
    ``PlaceholderWithDefault`` on the fill's device; returns how many it changed."""
    changed = 0
    for op in graph.get_operations():
        if op.type != "Fill":
            continue
        output, value = op.outputs[0], op.inputs[1]
        if (not output.shape.is_fully_defined() or value.op.type == "PlaceholderWithDefault"
                or output.shape.num_elements() * output.dtype.size < KEPT_FILL_BYTES):
            continue
        with graph.as_default(), tf.device(op.device):
            unfolded = tf.compat.v1.placeholder_with_default(value, value.shape,
                                                             name=f"{op.name}/not_folded")
        _tf_compat.replace_input(op, 1, unfolded)
        changed += 1
    return changed
