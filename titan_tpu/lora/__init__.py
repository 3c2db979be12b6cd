"""LoRA on the engine's side: which linears a run adapts and the swap on `meta`, how the adapters' factors
sit on the mesh, and what a LoRA run counts and saves. The layer itself is
`titan_tpu.models.common.lora.LoRALinear`; docs/lora.md says how to use it."""
