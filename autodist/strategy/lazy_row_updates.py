"""``LazyRowUpdates``: another builder's strategy, with some tables updated lazily.

A lazy update runs the optimizer on the rows a step looked up, even where the exact
update changes the other rows too: Adam's, momentum's and RMSprop's moments decay on
every row, so their exact update of a table stays dense, at the table's cost every
step. Lazily, rows without gradient keep their value and slots until a step looks
them up again (lazy Adam); training then differs from single-device training. It is
never on unless asked for, per variable, and AutoStrategy never asks.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from autodist.strategy.base import Strategy, StrategyBuilder, StrategyError


class LazyRowUpdates(StrategyBuilder):
    """Builds ``builder``'s strategy and sets ``lazy_row_update`` on the tables named.

    Args:
        builder: the builder whose strategy this changes.
        variables: names of the variables to update lazily; None: every variable with
            a sparse gradient. ``compile_strategy`` refuses a named variable whose
            gradient is not sparse, or whose optimizer is a ``tf.compat.v1`` one.
    """

    def __init__(self, builder: StrategyBuilder, variables: Optional[Sequence[str]] = None):
        if not isinstance(builder, StrategyBuilder):
            raise TypeError(f"LazyRowUpdates(builder=...) expects a strategy builder, got "
                            f"{type(builder).__name__}.")
        self._builder = builder
        self._variables = None if variables is None else tuple(variables)

    def build(self, graph_item: Any, resource_spec: Any) -> Strategy:
        strategy = self._builder.build(graph_item, resource_spec)
        names = [v.name for v in graph_item.trainable_variables]
        if self._variables is None:
            lazy = {v.name for v in graph_item.trainable_variables if v.sparse_grad}
        else:
            unknown = [name for name in self._variables if name not in names]
            if unknown:
                raise StrategyError(f"LazyRowUpdates(variables=...) names {unknown}, which the "
                                    f"model does not train; its variables are {names}.")
            lazy = set(self._variables)
        for node in strategy.node_config:
            node.lazy_row_update = node.var_name in lazy
        return strategy
