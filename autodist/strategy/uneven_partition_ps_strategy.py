"""An alias of ``autodist.strategy.UnevenPartitionedPS`` at this module path, for scripts written
for the original AutoDist (petuum/autodist)."""
from autodist.strategy.ps_builders import UnevenPartitionedPS

__all__ = ["UnevenPartitionedPS"]
