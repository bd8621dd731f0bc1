"""Distribution strategies and the builders that produce them."""
from autodist.strategy.all_reduce_builders import AllReduce, PartitionedAR, RandomAxisPartitionAR
from autodist.strategy.base import Strategy, StrategyBuilder, StrategyError
from autodist.strategy.parallax import Parallax
from autodist.strategy.ps_builders import PS, PartitionedPS, PSLoadBalancing, UnevenPartitionedPS

__all__ = [
    "AllReduce",
    "AutoStrategy",
    "BUILDERS",
    "PS",
    "Parallax",
    "PartitionedAR",
    "PartitionedPS",
    "PSLoadBalancing",
    "RandomAxisPartitionAR",
    "Strategy",
    "StrategyBuilder",
    "StrategyError",
    "UnevenPartitionedPS",
    "get_builder",
]

# Explicit name -> class registry, for choosing a builder from a config file.
BUILDERS = {
    cls.__name__: cls
    for cls in (PS, PSLoadBalancing, PartitionedPS, UnevenPartitionedPS,
                AllReduce, PartitionedAR, RandomAxisPartitionAR, Parallax)
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


def __getattr__(name: str):
    # AutoStrategy brings the learned simulator (Keras); load it only when asked for.
    if name == "AutoStrategy":
        from autodist.strategy.auto.builder import AutoStrategy
        return AutoStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
