"""The hf family's `[hf]` section: which transformers causal LM to build (a checkpoint folder's, or a
class at its config's sizes) and whether a folder's own modeling code may run. Imports nothing but the
configuration, so the loader reads it before torch or transformers load. It applies when
`[model] name = "hf"`; flavor and overrides stay in `[model]`."""

from __future__ import annotations

from dataclasses import dataclass

from titan_tpu.config.sections import opt, require


@dataclass
class HFConfig:
    config: str = opt(
        "",
        "A Hugging Face checkpoint folder (or its config.json) whose architecture and sizes to build with "
        "transformers' own modeling code; its weights load through checkpoint.initial_load_path.",
    )
    architecture: str = opt(
        "",
        "Without hf.config: a transformers causal-LM class, e.g. 'MistralForCausalLM', at its config "
        "class's default sizes (model.flavor 'config') or tiny ones (flavor 'debug'), with model.overrides.",
    )
    trust_remote_code: bool = opt(
        False, "Run the modeling code a checkpoint folder ships (auto_map) instead of refusing it."
    )

    def validate(self) -> None:
        require(
            bool(self.config) != bool(self.architecture),
            "hf.config",
            "model.name = 'hf' needs exactly one of hf.config (a checkpoint folder) and hf.architecture "
            f"(a transformers class), got config={self.config!r}, architecture={self.architecture!r}",
        )
