"""Checkpoints and SavedModels in the single-device layout, from and into any strategy."""
from autodist.checkpoint.saved_model import SavedModelBuilder
from autodist.checkpoint.saver import CheckpointError, Saver, latest_checkpoint

__all__ = ["CheckpointError", "Saver", "SavedModelBuilder", "latest_checkpoint"]
