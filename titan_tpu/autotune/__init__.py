"""Kernels chosen by measurement: every "auto" kernel field a model family lists as tunable
(titan_tpu/protocols/tunable.py) is timed at the run's shapes on the machine at hand and the
fastest candidate that agrees with a float32 reference wins. Rank 0 measures and broadcasts, and the
table is cached (`cache.py`) so that later runs on the same machine start at once."""
