"""What a run reports: step records and their sinks (`logger`: console, metrics.jsonl, TensorBoard,
W&B), the loss and benchmark charts (`plot`), and progress lines for the long waits before training
(`progress`). The peak FLOP/s behind MFU is the device's: `titan_tpu.device.peak`."""
