"""An alias of ``autodist.strategy.PS`` at this module path, for scripts written
for the original AutoDist (petuum/autodist)."""
from autodist.strategy.ps_builders import PS

__all__ = ["PS"]
