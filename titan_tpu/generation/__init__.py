"""Everything that samples from a model, for every task: the KV-cached sampler (sampler.py), the
builtin rollout engine over it (builtin.py), log-probabilities of tokens (logprobs.py) and the greedy
answer check (answers.py). Engines implement `titan_tpu.protocols.rollout.RolloutEngine`."""
