"""AutoDist: distributed training of single-device TensorFlow models by explicit strategies."""
from autodist.autodist import AutoDist

__all__ = ["AutoDist"]
