"""Partition arithmetic: how a variable is cut along one axis, without TensorFlow.

The one definition that builders, the compiler, the kernels and the cost model
share. A variable split into ``k`` parts along ``axis`` has the partitioner
string with ``k`` at ``axis`` and ``1`` elsewhere (``"1,3,1"``) and ``k`` parts
named ``"<var>/part_<i>"``, in order. Part ``i`` holds a contiguous slice; when
the size ``n`` along the axis is not a multiple of ``k``, the first ``n % k``
parts hold one extra row: ``[10, 4]`` cut by ``"3,1"`` gives 4, 3 and 3 rows.
"""
from __future__ import annotations

import dataclasses
from typing import List, Sequence, Tuple


@dataclasses.dataclass(frozen=True)
class PartitionPlan:
    """How one variable is cut.

    Attributes:
        axis: the partitioned axis.
        sizes: size of every part along ``axis``.
        shape: the full shape of the variable.
    """

    axis: int
    sizes: tuple
    shape: tuple

    @property
    def num_parts(self) -> int:
        return len(self.sizes)

    @property
    def offsets(self) -> tuple:
        starts, total = [], 0
        for size in self.sizes:
            starts.append(total)
            total += size
        return tuple(starts)

    def part_shape(self, part: int) -> tuple:
        shape = list(self.shape)
        shape[self.axis] = self.sizes[part]
        return tuple(shape)


def partition_sizes(dim: int, num_parts: int) -> List[int]:
    """Splits ``dim`` rows into ``num_parts`` contiguous parts differing by at most one.

    The first ``dim % num_parts`` parts get the extra row.

    Raises:
        ValueError: if ``num_parts`` is not in ``[1, dim]``.
    """
    if not 1 <= num_parts <= dim:
        raise ValueError(f"Cannot split dim={dim} into num_parts={num_parts}; need 1 <= parts <= dim.")
    base, extra = divmod(dim, num_parts)
    return [base + 1 if i < extra else base for i in range(num_parts)]


def part_shapes(shape: Sequence[int], axis: int, num_parts: int) -> List[Tuple[int, ...]]:
    """Returns the shapes of the parts of ``shape`` split along ``axis``."""
    shape = tuple(int(d) for d in shape)
    return [shape[:axis] + (rows,) + shape[axis + 1:]
            for rows in partition_sizes(shape[axis], num_parts)]


def partitioner_string(num_parts: int, axis: int, rank: int) -> str:
    """Formats a partitioner: ``num_parts`` at ``axis``, 1 elsewhere, e.g. ``"1,3,1"``.

    Raises:
        ValueError: if ``axis`` is outside ``[0, rank)`` or ``num_parts < 1``.
    """
    if not 0 <= axis < rank:
        raise ValueError(f"axis={axis} is out of range for a variable of rank={rank}.")
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got num_parts={num_parts}.")
    return ",".join(str(num_parts) if i == axis else "1" for i in range(rank))


def part_name(var_name: str, index: int) -> str:
    """Returns the name of partition ``index`` of ``var_name``: ``"<var>/part_<i>"``."""
    return f"{var_name}/part_{index}"


def parse_partitioner(partitioner: str, shape: Sequence[int], var_name: str) -> PartitionPlan:
    """Parses ``"1,3,1"`` for a variable of ``shape``.

    Raises:
        ValueError: naming the variable when the string does not fit the shape,
            splits more than one axis, or asks for more parts than the axis has
            elements.
    """
    shape = tuple(int(d) for d in shape)
    try:
        counts = [int(c) for c in partitioner.split(",")]
    except ValueError:
        raise ValueError(f"Variable '{var_name}': partitioner '{partitioner}' is not a "
                         "comma-separated list of integers.") from None
    if len(counts) != len(shape):
        raise ValueError(f"Variable '{var_name}': partitioner '{partitioner}' has "
                         f"{len(counts)} entries but the variable has rank {len(shape)}.")
    if any(c < 1 for c in counts):
        raise ValueError(f"Variable '{var_name}': partitioner '{partitioner}' has a count "
                         "below 1.")
    axes = [axis for axis, c in enumerate(counts) if c > 1]
    if len(axes) > 1:
        raise ValueError(f"Variable '{var_name}': partitioner '{partitioner}' splits "
                         f"{len(axes)} axes; only one axis can be partitioned.")
    axis = axes[0] if axes else 0
    parts = counts[axis] if axes else 1
    if parts > shape[axis]:
        raise ValueError(f"Variable '{var_name}': partitioner '{partitioner}' asks for "
                         f"{parts} parts of axis {axis}, which has {shape[axis]} elements.")
    return PartitionPlan(axis=axis, sizes=tuple(partition_sizes(shape[axis], parts)),
                         shape=shape)
