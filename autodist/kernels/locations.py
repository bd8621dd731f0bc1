"""Where each variable of the single-device graph lives in one node's distributed graph.

A checkpoint names the original variables; the distributed graph holds parts,
replicated copies, proxies and the slots of several optimizer copies. This
module maps the one onto the other: for every original variable, the value to
save (the full, synchronized one) and the variables a restore assigns on this
node.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional

import tensorflow as tf

from autodist.kernels import partitioner
from autodist.partition import PartitionPlan
from autodist.synchronizers.base import PartReader, Target, reader
from autodist.kernels.transformer import DistributedGraph, VariableStorage


@dataclasses.dataclass
class Location:
    """One original variable in the distributed graph.

    Attributes:
        reads: per part of the variable, what reads that part's value (whole or
            some rows), or None where this node cannot read them (a worker has no
            slots of the PS variables).
        parts: per part, the ``Target``s on this node that a restore assigns
            (their piece of) that part's slice to.
        plan: how the variable is cut, or None when it is whole.
        device: where the full value is assembled, or None for the read's own.
    """

    reads: Optional[List[PartReader]]
    parts: List[List[Target]]
    plan: Optional[PartitionPlan] = None
    device: Optional[str] = None

    @property
    def readable(self) -> bool:
        return self.reads is not None

    def value(self) -> tf.Tensor:
        """The full value to save (the original layout); only where ``readable``."""
        with tf.device(self.device):
            values = [read() for read in self.reads]
            return values[0] if self.plan is None else partitioner.stitch(values, self.plan)

    def restore(self, full_value: tf.Tensor) -> tf.Operation:
        """Assigns ``full_value`` (the original layout) to every target."""
        slices = ([full_value] if self.plan is None
                  else partitioner.split_value(full_value, self.plan))
        return tf.group(*[self.restore_part(index, piece) for index, piece in enumerate(slices)])

    def restore_part(self, index: int, piece: tf.Tensor) -> tf.Operation:
        """Assigns part ``index``'s slice of the value to that part's targets."""
        return tf.group(*[target.variable.assign(target.take(piece) if target.take else piece)
                          for target in self.parts[index]])


class Locator:
    """Finds the :class:`Location` of original variables in ``distributed``.

    On a cluster every node restores what lives on it, the chief also the PS
    variables and the shared non-trainables; only the chief saves.
    """

    def __init__(self, distributed: DistributedGraph):
        self._distributed = distributed
        item = distributed.item
        # original slot variable name -> (variable name, slot key)
        self._slot_of = {name: slot for name, slot in item.slot_names().items()
                         if slot[0] in distributed.storage}
        # original non-slot variable name -> (its optimizer call, key)
        self._non_slot_of = {name: (index, key)
                             for index, call in enumerate(item.optimizer_calls)
                             for name, key in call.non_slot_names().items()}

    def find(self, name: str) -> Optional[Location]:
        """The location of the original variable ``name``, or None when it has none."""
        distributed = self._distributed
        if name in distributed.storage:
            return self._trainable(distributed.storage[name])
        if name in self._slot_of:
            variable, slot_name = self._slot_of[name]
            return self._slot(distributed.storage[variable], slot_name)
        if name in self._non_slot_of:
            return self._non_slot(*self._non_slot_of[name])
        if name in distributed.shared_variables:
            variable = distributed.shared_variables[name]
            owned = not (distributed.ctx.shared_variables_on_chief and not distributed.ctx.is_chief)
            return Location([reader(variable)], [[Target(variable)] if owned else []])
        return None

    def _trainable(self, storage: VariableStorage) -> Location:
        parts = [part.synchronizer.restore_targets(part) for part in storage.parts]
        return Location([reader(part.copies[0]) for part in storage.parts], parts,
                        storage.compiled.plan, storage.device)

    def _slot(self, storage: VariableStorage, slot_name: str) -> Location:
        def slot_of(copy):
            return self._slot_variable(copy, slot_name)

        parts = [part.synchronizer.slot_targets(part, slot_of) for part in storage.parts]
        reads = [part.synchronizer.slot_value(part, slot_of) for part in storage.parts]
        readable = all(read is not None for read in reads)
        return Location(reads if readable else None, parts, storage.compiled.plan,
                        storage.device)

    def _slot_variable(self, copy: tf.Variable, slot_name: str) -> Optional[tf.Variable]:
        for optimizer in (o for update in self._distributed.updates for o in update.optimizers):
            slot = optimizer.slot(copy, slot_name)
            if slot is not None:
                return slot
        return None

    def _non_slot(self, call: int, key: str) -> Location:
        graph = self._distributed.graph
        copies = [variables[key] for variables in (
            o.non_slot_variables(graph) for o in self._distributed.updates[call].optimizers)
            if key in variables]
        return Location([reader(copies[0])] if copies else None,
                        [[Target(copy) for copy in copies]])

