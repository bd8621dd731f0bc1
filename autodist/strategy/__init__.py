"""Distribution strategies and the hand-written builders that produce them.

``AutoStrategy``, the builder that searches, runs jobs on clusters and so lives
above them, in :mod:`autodist.search`.
"""
from autodist.strategy.all_reduce_builders import AllReduce, PartitionedAR, RandomAxisPartitionAR
from autodist.strategy.base import Strategy, StrategyBuilder, StrategyError
from autodist.strategy.lazy_row_updates import LazyRowUpdates
from autodist.strategy.parallax import Parallax
from autodist.strategy.ps_builders import PS, PartitionedPS, PSLoadBalancing, UnevenPartitionedPS
from autodist.strategy.sharded_update_builders import ShardedUpdateAR

__all__ = [
    "AllReduce",
    "BUILDERS",
    "LazyRowUpdates",
    "PS",
    "Parallax",
    "PartitionedAR",
    "PartitionedPS",
    "PSLoadBalancing",
    "RandomAxisPartitionAR",
    "ShardedUpdateAR",
    "Strategy",
    "StrategyBuilder",
    "StrategyError",
    "UnevenPartitionedPS",
    "get_builder",
]

# Explicit name -> class registry, for choosing a builder from a config file. Not
# LazyRowUpdates: it wraps one of these, and AutoStrategy times these as they are.
BUILDERS = {
    cls.__name__: cls
    for cls in (PS, PSLoadBalancing, PartitionedPS, UnevenPartitionedPS,
                AllReduce, PartitionedAR, RandomAxisPartitionAR, Parallax, ShardedUpdateAR)
}


def get_builder(name: str, **kwargs) -> StrategyBuilder:
    """Instantiates the builder registered as ``name``.

    Args:
        name: a key of ``BUILDERS``, e.g. ``"PartitionedPS"``.
        **kwargs: constructor arguments of that builder.

    Returns:
        StrategyBuilder: the new builder.

    Raises:
        ValueError: if ``name`` is unknown (the message lists the valid names),
            or the builder rejects its arguments.
    """
    if name not in BUILDERS:
        raise ValueError(f"Unknown strategy builder name={name!r}; valid names are {sorted(BUILDERS)}.")
    return BUILDERS[name](**kwargs)

