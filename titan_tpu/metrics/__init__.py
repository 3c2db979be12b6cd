"""What a run reports: step records and their sinks (`logger`: console, metrics.jsonl, TensorBoard,
W&B), how they read on the console (`console`), the run's start-up and last lines and the time left
(`run_summary`), the loss and benchmark charts (`plot`), and progress lines for the long waits before
training (`progress`). The peak FLOP/s behind MFU is the device's: `titan_tpu.device.peak`."""
