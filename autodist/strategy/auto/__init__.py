"""AutoStrategy: guided sampling, a learned simulator and real trials find the strategy.

``sampler`` draws candidates, ``search`` runs the rounds, ``trial`` runs the
user's script under a candidate, ``builder`` puts them together as a builder.
"""
from autodist.strategy.auto.sampler import SamplerConstraints, StrategySampler, sample, sample_many

__all__ = ["SamplerConstraints", "StrategySampler", "sample", "sample_many"]
