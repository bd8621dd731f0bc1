"""``ENV``, the environment variables of the original AutoDist (petuum/autodist), at its
module path: an alias for scripts written for it, which read ``ENV.<NAME>.val``.

Of these AutoDist itself reads ``AUTODIST_WORKER`` only (the node address a
worker process runs for, set by its chief); the others are read here for such
scripts and change nothing in AutoDist.
"""
from __future__ import annotations

import enum
import os
from typing import Union


def _flag(text: str) -> bool:
    return text == "True"  # the original's reading: any other text is False


class ENV(enum.Enum):
    """An environment variable and how the original AutoDist read it.

    ``ENV.AUTODIST_WORKER.name`` is the variable's name and ``.val`` its value
    read now: a string (``""`` when unset; ``"INFO"`` for
    ``AUTODIST_MIN_LOG_LEVEL``), or a bool for the flags (true when set to
    ``"True"``; ``AUTODIST_PATCH_TF`` is true when unset).
    """

    # Each member's value is (the variable's name, its default text, whether it is a
    # flag); the name keeps the values distinct, so that no member is another's alias.
    AUTODIST_WORKER = ("AUTODIST_WORKER", "", False)
    AUTODIST_STRATEGY_ID = ("AUTODIST_STRATEGY_ID", "", False)
    AUTODIST_MIN_LOG_LEVEL = ("AUTODIST_MIN_LOG_LEVEL", "INFO", False)
    AUTODIST_IS_TESTING = ("AUTODIST_IS_TESTING", "False", True)
    AUTODIST_DEBUG_REMOTE = ("AUTODIST_DEBUG_REMOTE", "False", True)
    AUTODIST_PATCH_TF = ("AUTODIST_PATCH_TF", "True", True)
    AUTODIST_INTERNAL_TF = ("AUTODIST_INTERNAL_TF", "False", True)
    SYS_DATA_PATH = ("SYS_DATA_PATH", "", False)
    SYS_RESOURCE_PATH = ("SYS_RESOURCE_PATH", "", False)

    @property
    def val(self) -> Union[str, bool]:
        """The variable's value in the environment now, or its default when unset or empty."""
        _, default, is_flag = self.value
        text = os.environ.get(self.name) or default
        return _flag(text) if is_flag else text


Env = ENV  # the name early versions of the original AutoDist gave it
