"""AutoDist: distributed training of single-device TensorFlow models by explicit strategies."""

from autodist import _startup

__all__ = ["AutoDist", "gather_batch"]

_startup.install()  # before anything imports TensorFlow
_startup.own_thread_pools()  # before TensorFlow creates its first device


def __getattr__(name: str):
    # Imported on first use, so the command line starts without loading TensorFlow.
    if name == "AutoDist":
        from autodist.autodist import AutoDist
        return AutoDist
    if name == "gather_batch":
        from autodist.cross_replica import gather_batch
        return gather_batch
    raise AttributeError(f"module 'autodist' has no attribute {name!r}")
