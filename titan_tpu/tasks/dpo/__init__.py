"""Preference training (`training.task = "dpo"`): the task (task.py), its `[dpo]` section (config.py),
its pairs from records to batches (data.py, batch.py), the frozen reference (reference.py) and the
objective (loss.py). This door loads nothing, so the config loader reads config.py without the rest."""
