"""`python -m titan_tpu.doctor` (`titan-doctor`): the first command to run on a new machine or slice.

Run like training (plain, under `torchrun` or `titan-launch`), it measures what the trainer and the
planner assume about the hardware and says, line by line, whether it holds:

- `device_checks`: the device found and how, the dtype decision, matmul FLOP/s against the peak
  table, the compile backends;
- `kernel_checks`: every attention kernel and MoE experts implementation against its float32
  reference, and its speed;
- `collective_checks`: all-gather, reduce-scatter, all-reduce and all-to-all over every mesh axis,
  as bus bandwidth against the planner's figure (`expected.py`);
- `training_check`: ten steps of the debug model against the same steps on the CPU in float32.

Every line is a `rows.Row` with a verdict (ok / slow / wrong / unavailable) and its reason;
`report.py` prints the table and writes the JSON report the planner reads with `--calibration`.
"""
