"""Supervised fine-tuning (`training.task = "sft"`): the task (task.py), its `[sft]` section
(config.py), its data pipeline from records to packed rows (data.py) and its held-out answers
(answers.py). This door loads nothing, so the config loader reads config.py without the rest."""
