"""AutoStrategy: guided sampling, a learned simulator and real trials find the strategy.

``sampler`` draws candidates, ``search`` runs the rounds, ``trial`` runs the
user's script under a candidate, ``builder`` puts them together as a builder
(:class:`AutoStrategy`), ``commands`` are the ``autodist search`` command line.
"""
from autodist.search.sampler import SamplerConstraints, StrategySampler, sample, sample_many

__all__ = ["AutoStrategy", "SamplerConstraints", "StrategySampler", "sample", "sample_many"]


def __getattr__(name: str):
    # AutoStrategy brings the learned simulator (Keras); load it only when asked for.
    if name == "AutoStrategy":
        from autodist.search.builder import AutoStrategy
        return AutoStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
