"""One dataclass per TOML section. Every field carries a one-line doc (shown by `train.py --help`).

Choices are written as `Literal[...]` so that the loader can check them and list what is allowed.
Each section's `validate()` checks what can be checked without knowing the world size; checks that
need the process count (batch divisibility by data-parallel degree, mesh products) happen where the
mesh is built.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Literal

from titan_tpu.config.errors import ConfigError

# Value types of fields that other code (the planner's search) builds values for.
PipelineSchedule = Literal["1F1B", "Interleaved1F1B", "GPipe", "InterleavedZeroBubble"]
ReduceDtype = Literal["float32", "bfloat16"]
CheckpointMode = Literal["none", "full", "selective"]


def opt(default: Any, doc: str) -> Any:
    """A dataclass field with a default and its one-line doc."""
    return field(default=default, metadata={"doc": doc})


def opt_table(doc: str) -> Any:
    """A table field (a fresh empty dict per config) and its one-line doc."""
    return field(default_factory=dict, metadata={"doc": doc})


def opt_list(doc: str) -> Any:
    """A list field (a fresh empty list per config) and its one-line doc."""
    return field(default_factory=list, metadata={"doc": doc})


def require(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{key}: {message}")


@dataclass
class JobConfig:
    dump_folder: str = opt("./outputs", "Folder for metrics, the resolved config and checkpoints.")
    description: str = opt("", "Free text describing the run; written into the resolved config.")

    def validate(self) -> None:
        require(bool(self.dump_folder), "job.dump_folder", "must not be empty")


@dataclass
class DeviceConfig:
    type: Literal["auto", "tpu", "cuda", "cpu"] = opt(
        "auto", "Device to train on; auto picks tpu, then cuda, then cpu."
    )

    def validate(self) -> None:
        pass


@dataclass
class ModelConfig:
    name: str = opt("llama3", "Model family, a name from the model registry.")
    flavor: str = opt("debug", "Size of the model, a flavor of that family.")
    attention_block: int = opt(
        -1,
        "Causal attention kernel: 0 = scaled_dot_product_attention, N = plain matmuls in N-token "
        "query blocks, -1 = automatic: the fastest correct candidate measured at the run's shapes "
        "(SDPA, blocks of 64-512, splash on TPU), cached per machine.",
    )
    moe_impl: str = opt(
        "auto",
        "Mixture-of-experts expert matmuls (qwen3_moe): grouped_mm, padded_bmm, loop, ragged_dot "
        "(TorchTPU's grouped matmul, TPU only), or auto = the fastest correct candidate measured at the "
        "run's shapes, cached per machine. Every choice computes the same function.",
    )
    overrides: dict[str, Any] = opt_table(
        "Model arguments set on top of the flavor, e.g. { n_layers = 2, dim = 512 }; each is checked "
        "against the flavor's fields (max_seq_len comes from training.seq_len). For name = 'hf': "
        "fields of the transformers config, e.g. { hidden_size = 512, num_hidden_layers = 4 }.",
    )

    def validate(self) -> None:
        require(bool(self.name), "model.name", "must not be empty")
        require(bool(self.flavor), "model.flavor", "must not be empty")
        require(
            self.attention_block >= -1,
            "model.attention_block",
            f"must be -1, 0 or a block size, got {self.attention_block}",
        )


@dataclass
class TrainingConfig:
    steps: int = opt(200, "Number of optimizer steps to train for.")
    seq_len: int = opt(256, "Tokens per training sequence.")
    global_batch_size: int = opt(8, "Sequences per optimizer step, summed over all data-parallel ranks.")
    local_batch_size: int = opt(
        -1,
        "Sequences per forward pass on one rank; gradients accumulate up to the global batch. "
        "-1: global_batch_size / data-parallel degree (no accumulation).",
    )
    dtype: Literal["auto", "bfloat16", "float32"] = opt(
        "auto",
        "Compute dtype: auto = bfloat16 where the hardware computes it natively (TPUs, recent GPUs, "
        "CPUs with AVX512-BF16 or AMX), else float32; float32 turns mixed precision off.",
    )
    task: str = opt(
        "auto",
        "What to train: auto = the model family's own task, else a name from "
        "titan_tpu/tasks/registry.py (e.g. language_model).",
    )
    max_norm: float = opt(1.0, "Clip the global gradient norm to this value; 0 disables clipping.")
    seed: int = opt(0, "Seed for weight init, data order and dropout-free RNG state.")
    deterministic: bool = opt(False, "Use deterministic algorithms (bitwise-repeatable runs, slower).")

    def validate(self) -> None:
        require(self.steps >= 1, "training.steps", f"must be >= 1, got {self.steps}")
        require(self.seq_len >= 2, "training.seq_len", f"must be >= 2, got {self.seq_len}")
        require(
            self.global_batch_size >= 1,
            "training.global_batch_size",
            f"must be >= 1, got {self.global_batch_size}",
        )
        local = self.local_batch_size
        require(local == -1 or local >= 1, "training.local_batch_size", f"must be -1 or >= 1, got {local}")
        require(
            local == -1 or (self.global_batch_size >= local and self.global_batch_size % local == 0),
            "training.global_batch_size",
            f"must be a multiple of training.local_batch_size ({local}), got {self.global_batch_size}",
        )
        require(self.max_norm >= 0, "training.max_norm", f"must be >= 0, got {self.max_norm}")


@dataclass
class OptimizerConfig:
    name: Literal["AdamW"] = opt("AdamW", "Optimizer.")
    lr: float = opt(3e-4, "Peak learning rate (reached at the end of warmup).")
    beta1: float = opt(0.9, "AdamW beta1.")
    beta2: float = opt(0.95, "AdamW beta2.")
    eps: float = opt(1e-8, "AdamW epsilon.")
    weight_decay: float = opt(0.1, "Decoupled weight decay (not applied to norms and biases).")
    implementation: Literal["auto", "foreach", "fused", "for-loop"] = opt(
        "auto", "AdamW kernel: auto lets PyTorch choose; fused needs device support."
    )

    def validate(self) -> None:
        require(self.lr > 0, "optimizer.lr", f"must be > 0, got {self.lr}")
        for key in ("beta1", "beta2"):
            value = getattr(self, key)
            require(0 <= value < 1, f"optimizer.{key}", f"must be in [0, 1), got {value}")
        require(self.eps > 0, "optimizer.eps", f"must be > 0, got {self.eps}")
        require(self.weight_decay >= 0, "optimizer.weight_decay", "must be >= 0")


@dataclass
class LRSchedulerConfig:
    warmup_steps: int = opt(20, "Steps of linear warmup from near zero to optimizer.lr.")
    decay_type: Literal["linear", "cosine", "constant"] = opt("cosine", "Shape of the decay after warmup.")
    min_lr_ratio: float = opt(0.1, "Learning rate at the last step, as a fraction of optimizer.lr.")

    def validate(self) -> None:
        require(self.warmup_steps >= 0, "lr_scheduler.warmup_steps", "must be >= 0")
        require(
            0 <= self.min_lr_ratio <= 1,
            "lr_scheduler.min_lr_ratio",
            f"must be in [0, 1], got {self.min_lr_ratio}",
        )


@dataclass
class DataConfig:
    source: Literal["embedded", "files", "huggingface"] = opt(
        "embedded",
        "embedded: the Python standard library's own sources (no download); files: data.path; "
        "huggingface: a datasets name or folder in data.path.",
    )
    path: str = opt("", "File, folder or glob of .txt/.jsonl/.parquet files; or a datasets name.")
    text_field: str = opt("text", "Field holding the text in .jsonl, .parquet and datasets records.")
    hf_split: str = opt("train", "Split to read from a Hugging Face dataset.")
    tokenizer: str = opt("byte", "byte (built-in byte-level) or a path to a tokenizer.json or its folder.")
    chat_template: str = opt(
        "",
        "Jinja chat template file for fine-tuning (sft): replaces the template of the tokenizer's "
        "folder, or supplies one where the folder has none.",
    )
    document_mask: bool = opt(
        False,
        "Keep the documents packed into a sequence apart: positions restart after each end-of-text "
        "token and attention stays inside each document.",
    )
    shuffle: bool = opt(True, "Shuffle packed sequences within a buffer (seeded).")
    shuffle_buffer: int = opt(1024, "Number of packed sequences shuffled together.")

    def validate(self) -> None:
        if self.source in ("files", "huggingface"):
            require(bool(self.path), "data.path", f"is required when data.source = '{self.source}'")
        else:
            require(
                not self.path,
                "data.path",
                f"'{self.path}' is not read when data.source = 'embedded'; set data.source = 'files' "
                "(or 'huggingface') to train on it",
            )
        require(self.shuffle_buffer >= 1, "data.shuffle_buffer", "must be >= 1")
        require(bool(self.tokenizer), "data.tokenizer", "must be 'byte', 'chatml_bytes' or a path")


@dataclass
class ParallelismConfig:
    dp_replicate: int = opt(1, "Data-parallel replicas (HSDP outer axis, spans slices over DCN).")
    dp_shard: int = opt(-1, "FSDP shard degree; -1 takes every process not used by the other axes.")
    tp: int = opt(1, "Tensor-parallel degree (innermost axis, fastest links).")
    ep: int = opt(1, "Expert-parallel degree for MoE models, carved from dp_shard.")
    cp: int = opt(
        1,
        "Context-parallel degree: each sample's sequence split over cp ranks (2 chunks each, balanced "
        "for the causal mask); keys and values all-gathered in every attention layer.",
    )
    pp: int = opt(
        1,
        "Pipeline-parallel degree (outermost axis): the model's layers split into stages, one stage (or "
        "several, with an interleaved schedule) per pp rank.",
    )
    pp_schedule: PipelineSchedule = opt(
        "1F1B",
        "With pp > 1, the order of micro-batch forwards and backwards (torch.distributed.pipelining); the "
        "interleaved ones run two stages per rank.",
    )
    pp_microbatches: int = opt(
        -1, "With pp > 1, micro-batches each local batch is split into; -1 = the number of stages."
    )
    pp_layers_per_stage: int = opt(
        -1,
        "With pp > 1, decoder layers in each stage; -1 = the model's layers split evenly over the stages (one "
        "per pp rank, two with an interleaved schedule).",
    )
    sequence_parallel: bool = opt(True, "With tp > 1, shard norms and residuals along the sequence.")
    loss_parallel: bool = opt(False, "With tp > 1, compute the loss on vocab-sharded logits.")
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = opt(
        "default", "Free gathered parameters after forward: default = all blocks but the last."
    )
    fsdp_reduce_dtype: ReduceDtype = opt("float32", "Dtype in which FSDP reduces gradients.")
    fsdp_cpu_offload: bool = opt(False, "Keep sharded parameters and optimizer state in host memory.")

    def validate(self) -> None:
        for key in ("dp_replicate", "tp", "ep", "cp", "pp"):
            value = getattr(self, key)
            require(value >= 1, f"parallelism.{key}", f"must be >= 1, got {value}")
        for key in ("pp_microbatches", "pp_layers_per_stage"):
            value = getattr(self, key)
            require(value == -1 or value >= 1, f"parallelism.{key}", f"must be -1 or >= 1, got {value}")
        require(
            self.dp_shard == -1 or self.dp_shard >= 1,
            "parallelism.dp_shard",
            f"must be -1 or >= 1, got {self.dp_shard}",
        )


@dataclass
class CommConfig:
    init_timeout_seconds: int = opt(
        600,
        "Seconds a collective may wait for its peers while the job starts: process-group creation "
        "and the whole first step (compilation, checkpoint loading, the first record).",
    )
    train_timeout_seconds: int = opt(
        300,
        "Seconds a collective may wait for its peers after the first step; a stopped, hung or lost "
        "process then ends the job instead of hanging it. Must cover a checkpoint save and an evaluation.",
    )

    def validate(self) -> None:
        for key in ("init_timeout_seconds", "train_timeout_seconds"):
            value = getattr(self, key)
            require(value > 0, f"comm.{key}", f"must be > 0 seconds, got {value}")


@dataclass
class ActivationCheckpointConfig:
    mode: CheckpointMode = opt("none", "Recompute activations in backward: none, every block (full), or selective.")
    selective_option: str = opt(
        "2", "With mode = selective: 'op' (save matmul outputs) or N (checkpoint every Nth block)."
    )
    offload: bool = opt(
        False,
        "Keep what each checkpointed block saves for backward (its inputs) in host memory until its "
        "recomputation; on a CPU host the same hooks run and copy nothing.",
    )

    def validate(self) -> None:
        require(
            not (self.offload and self.mode == "none"),
            "activation_checkpoint.offload",
            "offloads what checkpointed blocks keep; set mode = full or selective with it",
        )
        option = self.selective_option
        require(
            option == "op" or (option.isdigit() and int(option) >= 1),
            "activation_checkpoint.selective_option",
            f"must be 'op' or a positive integer, got '{option}'",
        )

    @property
    def op_level(self) -> bool:
        """Selective per op: every block keeps its matmul and attention outputs and recomputes the rest."""
        return self.mode == "selective" and self.selective_option == "op"

    def wraps_block(self, index: int) -> bool:
        """Whether block `index` (counted across the model's block containers) is checkpointed: every
        block under full and op-level selective, blocks 0, N, 2N, ... under selective N."""
        if self.mode == "none":
            return False
        if self.mode == "full" or self.op_level:
            return True
        return index % int(self.selective_option) == 0

    def recomputed_blocks(self, n_blocks: int) -> int:
        """Blocks of `n_blocks` whose whole forward runs again in backward (op-level recomputes only
        elementwise work, so none)."""
        return 0 if self.op_level else sum(self.wraps_block(index) for index in range(n_blocks))


@dataclass
class CompileConfig:
    enable: bool = opt(False, "torch.compile each transformer block (the loss stays eager, its chunk measured).")
    backend: str = opt("auto", "torch.compile backend; auto = the device's default (inductor, or torch_tpu's).")

    def validate(self) -> None:
        require(bool(self.backend), "compile.backend", "must not be empty")


@dataclass
class CheckpointConfig:
    enable: bool = opt(False, "Save checkpoints with torch.distributed.checkpoint and resume from them.")
    folder: str = opt("checkpoint", "Checkpoint folder, relative to job.dump_folder.")
    interval: int = opt(500, "Save every this many steps (and at the last step).")
    keep_latest_k: int = opt(3, "Keep this many newest complete checkpoints; 0 keeps all.")
    async_mode: Literal["disabled", "async"] = opt(
        "disabled", "async writes in the background while training continues."
    )
    load_step: int = opt(-1, "Resume from this step; -1 takes the newest complete checkpoint.")
    on_damage: Literal["fallback", "stop"] = opt(
        "fallback",
        "When the newest checkpoint fails its check at resume (a file missing, truncated or not matching its "
        "CRC-32): fallback = move it aside as step-N.damaged-<why> (kept, never loaded) and resume from the "
        "previous one; stop = refuse to start, naming the file. A load_step named explicitly always stops.",
    )
    initial_load_path: str = opt(
        "", "Hugging Face folder (config.json + safetensors) to take the initial weights from."
    )
    export_dtype: Literal["float32", "bfloat16"] = opt("float32", "Dtype of weights exported to Hugging Face format.")
    create_seed_checkpoint: bool = opt(
        False, "Write step-0 initial weights and exit, so differently laid out runs start equal."
    )
    preemption_grace_s: int = opt(
        30,
        "Seconds between SIGTERM and SIGKILL when a pod is preempted or evicted: on SIGTERM (or SIGINT) the run "
        "ends the step in progress, saves it and exits. The step plus the save must fit in it; the save's time is "
        "logged against it, and render_jobset.py writes it as the pods' terminationGracePeriodSeconds.",
    )

    def validate(self) -> None:
        require(self.interval >= 1, "checkpoint.interval", f"must be >= 1, got {self.interval}")
        require(
            self.preemption_grace_s >= 1,
            "checkpoint.preemption_grace_s",
            f"must be >= 1 (seconds), got {self.preemption_grace_s}",
        )
        require(self.keep_latest_k >= 0, "checkpoint.keep_latest_k", "must be >= 0")
        require(self.load_step >= -1, "checkpoint.load_step", f"must be -1 or a step, got {self.load_step}")
        require(
            self.load_step == -1 or self.enable,
            "checkpoint.load_step",
            f"{self.load_step} is a step to resume from, and nothing is loaded while checkpoint.enable = false; "
            "set checkpoint.enable = true",
        )


@dataclass
class MetricsConfig:
    log_freq: int = opt(10, "Log one record every this many steps (and at the first and last step).")
    enable_tensorboard: bool = opt(False, "Also write TensorBoard event files to dump_folder/tb.")
    enable_wandb: bool = opt(False, "Also log to Weights & Biases (offline unless you are logged in).")
    wandb_project: str = opt("titan_tpu", "Weights & Biases project name.")
    eval_freq: int = opt(
        0,
        "Evaluate (held-out metrics, samples) every this many steps and at the last step; 0 = never, "
        "except the last step's held-out loss when [validation] is enabled.",
    )
    plot_loss: bool = opt(True, "At the end of the run, draw the loss curve into dump_folder/loss.png.")

    def validate(self) -> None:
        require(self.log_freq >= 1, "metrics.log_freq", f"must be >= 1, got {self.log_freq}")
        require(self.eval_freq >= 0, "metrics.eval_freq", f"must be >= 0, got {self.eval_freq}")


@dataclass
class ProfilingConfig:
    enable: bool = opt(False, "Trace optimizer steps with torch.profiler (Perfetto / TensorBoard traces).")
    start_step: int = opt(3, "First traced optimizer step (1-based; the first steps compile and warm up).")
    active_steps: int = opt(2, "Number of consecutive steps traced from start_step.")
    trace_folder: str = opt("profile_traces", "Folder for the traces, relative to job.dump_folder.")
    memory: bool = opt(False, "Also record allocations: in the trace, and on CUDA an allocator snapshot (memory viz).")

    def validate(self) -> None:
        require(self.start_step >= 1, "profiling.start_step", f"must be >= 1, got {self.start_step}")
        require(self.active_steps >= 1, "profiling.active_steps", f"must be >= 1, got {self.active_steps}")
        require(bool(self.trace_folder), "profiling.trace_folder", "must not be empty")


@dataclass
class ValidationConfig:
    enable: bool = opt(
        False,
        "Measure held-out loss and perplexity every metrics.eval_freq steps and at the last step (only "
        "there when eval_freq = 0); language-model and sft tasks; dpo: held-out reward accuracy and margin.",
    )
    source: Literal["files", "huggingface", "generated"] = opt(
        "files",
        "files: validation.path; huggingface: a datasets folder or name in validation.path; "
        "generated: the held-out examples of sft.dataset or dpo.dataset = 'generated' (sft and dpo tasks).",
    )
    path: str = opt("", "File, folder or glob of .txt/.jsonl/.parquet files; or a datasets name.")
    hf_split: str = opt("validation", "Split to read from a Hugging Face dataset.")
    batches: int = opt(
        4,
        "Batches of training.global_batch_size sequences per evaluation: the same sequences each time, "
        "from the start of the source; a source with fewer is refused, not repeated.",
    )

    def validate(self) -> None:
        if self.enable and self.source != "generated":
            require(bool(self.path), "validation.path", f"is required when validation.source = '{self.source}'")
        require(self.batches >= 1, "validation.batches", f"must be >= 1, got {self.batches}")


# The value of lora.target_modules that stands for every linear of the repeated blocks.
ALL_LINEAR = "all-linear"


@dataclass
class LoRAConfig:
    enable: bool = opt(
        False,
        "Train low-rank adapters (LoRA) on a frozen model instead of all its weights: the base is not trained, "
        "saved or given optimizer state (docs/lora.md).",
    )
    rank: int = opt(16, "With enable: the adapters' rank r (A is [r, in], B is [out, r]).")
    alpha: float = opt(32.0, "With enable: the adapters' output is scaled by alpha / rank.")
    dropout: float = opt(0.0, "With enable: dropout on the adapters' input while training, in [0, 1).")
    target_modules: list[str] = field(
        default_factory=lambda: [ALL_LINEAR],
        metadata={
            "doc": "With enable: the nn.Linear modules adapted. 'all-linear' = every one inside the repeated "
            "blocks but a mixture-of-experts router (not the head); else patterns matched against a module's "
            "qualified name, fnmatch-style, each also as '*.' + pattern (PEFT's suffix rule): 'wq', '*.wq', "
            "'layers.0.*'.",
        },
    )

    def validate(self) -> None:
        if not self.enable:
            for key in ("rank", "alpha", "dropout", "target_modules"):
                require(
                    getattr(self, key) == _default_of(LoRAConfig, key),
                    f"lora.{key}",
                    "applies when lora.enable = true; set lora.enable = true or remove it",
                )
            return
        require(self.rank >= 1, "lora.rank", f"must be >= 1, got {self.rank}")
        require(self.alpha > 0, "lora.alpha", f"must be > 0, got {self.alpha}")
        require(0 <= self.dropout < 1, "lora.dropout", f"must be in [0, 1), got {self.dropout}")
        targets = self.target_modules
        require(bool(targets), "lora.target_modules", f"must name at least one module, e.g. ['{ALL_LINEAR}']")
        require(
            ALL_LINEAR not in targets or len(targets) == 1,
            "lora.target_modules",
            f"'{ALL_LINEAR}' already names every linear of the blocks; give it alone or list patterns instead",
        )
        require(all(targets), "lora.target_modules", "an empty pattern matches nothing; remove it")


def _default_of(section: type, key: str) -> Any:
    spec = next(f for f in fields(section) if f.name == key)
    return spec.default_factory() if spec.default_factory is not MISSING else spec.default
