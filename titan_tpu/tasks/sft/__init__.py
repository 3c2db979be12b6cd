"""Supervised fine-tuning (`training.task = "sft"`, section `[sft]`): the task (task.py), its data
pipeline from records to packed rows (data.py) and its held-out answers (answers.py)."""
