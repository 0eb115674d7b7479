"""Callbacks: attention overlays (W&B), a checkpoint on Ctrl-C / SIGTERM, `last.ckpt` as the
newest state (`LatestCheckpoint`), saved atomically (`AtomicCheckpointIO`, a trainer plugin),
the writer of `captioning predict`'s captions (COCO-style results JSON, merged across DDP
ranks), the run folder's list of the data's problems (`DataProblemsFile`), the W&B logger the
configs use, and the temperature schedule of Gumbel-softmax hard attention."""

from captioning.callbacks.checkpoint_io import AtomicCheckpointIO
from captioning.callbacks.gumbel import GumbelTemperature
from captioning.callbacks.interrupt import CheckpointOnInterrupt, last_checkpoint_path
from captioning.callbacks.latest import LatestCheckpoint
from captioning.callbacks.logger import WandbLogger
from captioning.callbacks.overlays import AttentionOverlayCallback
from captioning.callbacks.predictions import CaptionWriter
from captioning.callbacks.problems import DataProblemsFile

__all__ = ["AtomicCheckpointIO", "AttentionOverlayCallback", "CaptionWriter",
           "CheckpointOnInterrupt", "DataProblemsFile", "GumbelTemperature", "LatestCheckpoint",
           "WandbLogger", "last_checkpoint_path"]
