"""An alias of ``autodist.strategy.RandomAxisPartitionAR`` at this module path, for scripts written
for the original AutoDist (petuum/autodist)."""
from autodist.strategy.all_reduce_builders import RandomAxisPartitionAR

__all__ = ["RandomAxisPartitionAR"]
