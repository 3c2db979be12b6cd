"""Launching training runs: GKE TPU slices, JobSet manifests and the per-host launcher."""
