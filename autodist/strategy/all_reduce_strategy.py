"""An alias of ``autodist.strategy.AllReduce`` at this module path, for scripts written
for the original AutoDist (petuum/autodist)."""
from autodist.strategy.all_reduce_builders import AllReduce

__all__ = ["AllReduce"]
