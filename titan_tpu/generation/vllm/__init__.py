"""The vLLM rollout engine: a vLLM server in its own process and environment (environment.py,
server.py), spoken to over its OpenAI-compatible HTTP API with token ids in and out (client.py), and
the `RolloutEngine` over one or more such servers, with the trainer's weights pushed to them
(engine.py). The package needs no vLLM in the trainer's environment."""
