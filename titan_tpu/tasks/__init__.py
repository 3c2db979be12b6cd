"""Training tasks: what differs between kinds of training (base.py); the trainer runs any of them.

Deliberately empty of imports: the config layer reads the tasks' config sections
(`titan_tpu.tasks.<task>.config`) without loading torch, so import `titan_tpu.tasks.base` and
`titan_tpu.tasks.registry` by their full names.
"""
