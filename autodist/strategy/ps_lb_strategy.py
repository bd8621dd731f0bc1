"""An alias of ``autodist.strategy.PSLoadBalancing`` at this module path, for scripts written
for the original AutoDist (petuum/autodist)."""
from autodist.strategy.ps_builders import PSLoadBalancing

__all__ = ["PSLoadBalancing"]
