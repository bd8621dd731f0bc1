"""Names and walks over a GraphDef's nodes, shared by the graph's analyses."""
from __future__ import annotations

from typing import Iterable

# The op entering a tf.compat.v1 loop (control flow v1), naming it by an attribute.
V1_LOOP_ENTERS = ("Enter", "RefEnter")


def op_name(name: str) -> str:
    """The op of a tensor name or NodeDef input (``"^op"``, ``"op:1"`` -> ``"op"``)."""
    return name.lstrip("^").split(":")[0]


def tensor_name(name: str) -> str:
    """A NodeDef input naming an op's first output as a tensor name (``"op"`` -> ``"op:0"``)."""
    return name if ":" in name else name + ":0"


def data_inputs(node) -> list:
    """A NodeDef's inputs but its control edges (``"^op"``)."""
    return [i for i in node.input if not i.startswith("^")]


def ancestors(nodes: dict, names: Iterable[str], control: bool) -> set:
    """The ops (within ``nodes``, name -> NodeDef) that ``names`` depend on, themselves
    included; through control edges too when ``control``."""
    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen or name not in nodes:
            continue
        seen.add(name)
        node = nodes[name]
        todo.extend(op_name(i) for i in (node.input if control else data_inputs(node)))
    return seen
