"""The Keras 3 / TF2 front end: ``model.fit`` under ``ad.scope()`` and ``ad.function``."""
