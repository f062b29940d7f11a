"""Training: an EAGLE-3 drafter with training-time test on stored states, a live target, or a store still being written.

`config.py` is the config (`TrainConfig` and its sections; `HyperParams` and `StreamParams` the serve loop embeds);
`stage.py` is `hstap train` (run directory, the loop), `inputs.py` resolves a run once into `plan.py`'s `TrainPlan`;
`data.py` what it reads (store or live target, eval split, aux-layer selection, vocab map); `ttt.py` the training-time
test (masks, target distribution, objectives, chain replay, FLOPs); `trainer.py` the drafter under training (DDP/FSDP2
wrapping, AdamW, schedule); `checkpoint.py` atomic checkpoints and exact resume; `log.py` the metrics; `follow.py`
`--follow`, the stream over a growing store, and `follow_plan.py` its pure plan (canonical order, slot plans: passes,
replay, anchor, holdout).
"""
