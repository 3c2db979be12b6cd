"""The builtin rollout engine: the KV-cached sampler (sampler.py) on the trainer's own modules, in the
trainer's processes. It needs nothing else installed and is exact: its log-probabilities are the ones a
training forward of the same weights computes.

It samples from the live policy module it was given, so loading new weights is taking that module
again (no copy); under FSDP every group is gathered once per `generate` call, not once per token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from titan_tpu.generation.sampler import gathered_for_generation, generate_by_length, row_uniforms
from titan_tpu.protocols.model_spec import Decoding
from titan_tpu.protocols.rollout import Rollout, SamplingParams


class BuiltinEngine:
    """`RolloutEngine` over a model that decodes with `decoding` (the family's KV cache and step).

    `reshard_after(group)`: each FSDP group's reshard-after-forward setting, given back after a call.
    `buckets`: prompts are sampled sorted by length in this many batches (sampler.generate_by_length).
    `lockstep`: the group whose ranks hold other prompts but exchange activations in every forward
    (expert parallelism); its ranks stop together and must pass as many prompts.
    """

    def __init__(
        self,
        decoding: Decoding,
        pad_id: int,
        device: torch.device,
        reshard_after: Callable[[nn.Module], bool],
        buckets: int = 1,
        lockstep: dist.ProcessGroup | None = None,
    ) -> None:
        self.decoding = decoding
        self.pad_id = pad_id
        self.device = device
        self.reshard_after = reshard_after
        self.buckets = buckets
        self.lockstep = lockstep
        self.policy: nn.Module | None = None
        self.version = -1

    def load_weights(self, policy: nn.Module, version: int) -> None:
        self.policy, self.version = policy, version

    @torch.no_grad()
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int] | None = None
    ) -> Rollout:
        if self.policy is None:
            raise RuntimeError("BuiltinEngine.generate before load_weights: no policy to sample from")
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts; one seed per prompt")
        uniforms = None if seeds is None or params.temperature == 0 else row_uniforms(seeds, params.max_new_tokens)
        with gathered_for_generation(self.policy, self.reshard_after):
            out = generate_by_length(
                self.policy,
                self.decoding,
                prompts,
                params,
                self.pad_id,
                self.device,
                self.buckets,
                uniforms,
                self.lockstep,
            )
        return Rollout(tokens=out.lists(), logps=out.logp_lists(), stopped=out.stopped.tolist())

    def describe(self) -> str:
        return f"builtin KV-cached sampler, weights of step {self.version}"
