"""The `captioning` commands, one module each; `captioning.cli` dispatches to them.

* `lightning`: fit / validate / test through `CaptioningCLI` (LightningCLI)
* `demo`: generate shapes, train, test, print results
* `caption`: caption images with a checkpoint (no Lightning)
* `predict`: caption many images (folders, globs, list files) with `Trainer.predict`, on one
  device or many (DDP), into a COCO-style results JSON
* `shapes`: write the synthetic shapes dataset
* `cache_features`: build the frozen-encoder feature cache ahead of time
* `ablate`: train and test every variant × seed of an ablation grid (`configs/ablations/`);
  `ablation_report` writes its table and plot
* `errors`: user errors and interruptions as one line and an exit status
"""
