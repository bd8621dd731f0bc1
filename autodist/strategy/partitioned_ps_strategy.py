"""An alias of ``autodist.strategy.PartitionedPS`` at this module path, for scripts written
for the original AutoDist (petuum/autodist)."""
from autodist.strategy.ps_builders import PartitionedPS

__all__ = ["PartitionedPS"]
