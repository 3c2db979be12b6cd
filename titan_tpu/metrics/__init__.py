"""Step records, their sinks, and the peak FLOP/s behind MFU."""
