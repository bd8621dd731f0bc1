"""An alias of ``autodist.strategy.PartitionedAR`` at this module path, for scripts written
for the original AutoDist (petuum/autodist)."""
from autodist.strategy.all_reduce_builders import PartitionedAR

__all__ = ["PartitionedAR"]
