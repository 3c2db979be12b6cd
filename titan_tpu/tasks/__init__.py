"""Training tasks: what differs between kinds of training (base.py); the trainer runs any of them.

Deliberately empty of imports, so that `titan_tpu.tasks.registry` (a table of names) can be imported
without loading any task: import `titan_tpu.tasks.base` and `titan_tpu.tasks.registry` by their full
names.
"""
