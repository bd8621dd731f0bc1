"""An alias of ``autodist.strategy.Parallax`` at this module path, for scripts written
for the original AutoDist (petuum/autodist)."""
from autodist.strategy.parallax import Parallax

__all__ = ["Parallax"]
