"""Checkpoints: sharded save/resume with torch.distributed.checkpoint, crash-safe commit, retention,
async saves, and Hugging Face safetensors in and out."""

from titan_tpu.checkpoint.manager import CheckpointManager

__all__ = ["CheckpointManager"]
