"""The dry run: a config's own set-up and one training step at a world size that is not here.

`python -m titan_tpu.dryrun --config NAME --world N [--rank R ...]` (or `train.py ... --dry-run
--world N`) runs, in this one process, the trainer's set-up for simulated rank R of N (torch's fake
process group, the model on `meta`), then one micro-batch's forward and backward and the optimizer
step on fake tensors, recording every collective; it reports each asked rank (the first and the
last by default) as a table and as JSON. Nothing is allocated for the weights and nothing is sent.
"""
