"""The one training loop and what it is made of: the trainer (trainer.py), a step's forward and
backward over micro-batches or pipeline stages (forward_backward.py), the window of steps a record
covers (record_window.py), seeding, and a config's names checked against the registries
(registered_names.py, which every entry point uses). This door loads nothing: import each name from
its module."""
