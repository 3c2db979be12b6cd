"""Layers and helpers shared by the decoder-only model families (Llama 3, Qwen 3, ...): the decoder
family kit. Import each from its module."""
