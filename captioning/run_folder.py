"""A run folder's layout (`trainer.default_root_dir`): torch-free, for the commands that read
configs before any model is built."""

#: The checkpoint folder inside a run folder: where `LatestCheckpoint`, `CheckpointOnInterrupt`,
#: `--ckpt_path RUN` and the shipped trainer configs put the checkpoints.
RUN_CHECKPOINTS = "checkpoints"
