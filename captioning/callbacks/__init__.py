"""Training callbacks: attention overlays (W&B) and a checkpoint on Ctrl-C / SIGTERM."""

from captioning.callbacks.interrupt import CheckpointOnInterrupt, last_checkpoint_path
from captioning.callbacks.overlays import AttentionOverlayCallback

__all__ = ["AttentionOverlayCallback", "CheckpointOnInterrupt", "last_checkpoint_path"]
