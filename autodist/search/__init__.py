"""AutoStrategy: guided sampling, a learned simulator and real trials find the strategy.

``sampler`` draws candidates, ``search`` runs the rounds, ``trial`` runs the
user's script under a candidate, ``builder`` puts them together as a builder
(:class:`AutoStrategy`), ``commands`` are the ``autodist search`` command line.
"""
import importlib

__all__ = ["AutoStrategy", "SamplerConstraints", "StrategySampler", "sample", "sample_many"]

_HOMES = {"AutoStrategy": "builder", "SamplerConstraints": "sampler",
          "StrategySampler": "sampler", "sample": "sampler", "sample_many": "sampler"}


def __getattr__(name: str):
    # Loaded when asked for: the command line starts without TensorFlow, which the
    # sampler's synchronizer kinds and AutoStrategy's learned simulator bring.
    if name in _HOMES:
        return getattr(importlib.import_module(f"autodist.search.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
