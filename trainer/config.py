"""The configuration schema: what a preset file may say, with one line of documentation per field.

Sections mirror the preset files (`hardware`, `model`, `data`, `train`, `deepspeed`, `logging`).
This module only declares; `trainer.presets` loads files into it (`trainer.strict`: unknown keys and wrong
types are errors) and `trainer.resolve` fills "auto", solves the batch triad and validates.
The `deepspeed` section is DeepSpeed's own JSON, kept as a dict and owned by `trainer.ds`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Optional, Union

from .numbers import (COUNT, COUNT_OR_ZERO, FRACTION, GIGABYTES, NONNEGATIVE, POSITIVE, PROBABILITY, RANKS_PER_NODE,
                      SEED, SEQUENCE_TOKENS, TEMPERATURE, WHOLE_SECONDS, Kind)


AUTO = "auto"


def doc(text: str, default: Any = None, factory: Any = None, kind: Optional[Kind] = None, multiline: bool = False):
    """A dataclass field with its one-line documentation (and, for numbers, the kind that says which values are
    valid: trainer/numbers.py, checked when a preset is read) kept in the field's metadata. Strings are one line
    (names and paths reach launch scripts and log lines) unless the field is `multiline` (prose: prompts)."""
    metadata = {"doc": text, "kind": kind, "multiline": multiline}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class HardwareConfig:
    gpu: str = doc("GPU type: a name or alias from trainer/accelerators.yaml (a100-80g, h100, mi300x, ...) "
                   "or 'cpu'.", "cpu")
    gpus_per_node: int = doc("Ranks per node (GPUs per node; CPU ranks for 'cpu').", 1, kind=RANKS_PER_NODE)
    nodes: int = doc("Number of nodes; world size = nodes x gpus_per_node.", 1, kind=COUNT)
    cpu_ram_gb: Optional[float] = doc("Host RAM per node in GB (planner: offload budget).", None, kind=GIGABYTES)
    nvme_gb: Optional[float] = doc("Local NVMe per node in GB (planner: ZeRO-Infinity budget).", None, kind=GIGABYTES)


# What LoRA can target in the Llama-style decoders (llama, mistral, qwen2): their linear layers, the two ends, and
# PEFT's "all-linear". Other architectures (MoE families, a pretrained model of another model_type) are checked against
# the built model, before PEFT sees them (trainer.moe.lora_target_problems).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head",
                "embed_tokens", "all-linear")
LLAMA_LIKE = ("llama", "mistral", "qwen2")


@dataclass
class LoraConfig:
    enabled: bool = doc("Train LoRA adapters (PEFT) instead of all weights.", False)
    r: int = doc("LoRA rank.", 16, kind=COUNT)
    alpha: int = doc("LoRA scaling numerator (scale = alpha / r).", 32, kind=COUNT)
    dropout: float = doc("Dropout on the LoRA input.", 0.05, kind=FRACTION)
    target_modules: list[str] = doc(
        "Module names that get adapters.", factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    target_parameters: list[str] = doc(
        "Parameters that get adapters (PEFT target_parameters): the fused 3D expert weights of MoE models, which are "
        "no nn.Linear in transformers 5.x, e.g. [experts.gate_up_proj, experts.down_proj].", factory=list)


@dataclass
class ModelConfig:
    name_or_path: Optional[str] = doc(
        "Local directory or hub id with pretrained weights; None trains the inline architecture from scratch.", None)
    family: str = doc("Architecture family of the inline config (a transformers model_type: llama, mistral, qwen2, "
                      "mixtral, qwen3_moe).", "llama")
    hidden_size: int = doc("Model width h.", 4096, kind=COUNT)
    num_layers: int = doc("Transformer blocks L.", 32, kind=COUNT)
    num_heads: int = doc("Attention (query) heads.", 32, kind=COUNT)
    num_kv_heads: Optional[int] = doc("Key/value heads (GQA); None means num_heads (MHA).", None, kind=COUNT)
    intermediate_size: int = doc("SwiGLU MLP width (MoE families: each expert's).", 11008, kind=COUNT)
    head_dim: Optional[int] = doc("MoE families: width of one attention head; None = hidden_size / num_heads "
                                  "(Qwen3-MoE's is free: 128 at hidden 2048 with 32 heads).", None, kind=COUNT)
    num_experts: Optional[int] = doc("MoE families (mixtral, qwen3_moe): experts per layer; None for dense families.",
                                     None, kind=COUNT)
    num_experts_per_tok: Optional[int] = doc("MoE: experts each token is routed to (top-k); None = 2.", None,
                                             kind=COUNT)
    router_aux_loss_coef: Optional[float] = doc(
        "MoE: weight of the router load-balancing loss added to the LM loss when output_router_logits is on "
        "(transformers' router_aux_loss_coef); None = the model's own (0.001 in transformers' defaults).", None,
        kind=NONNEGATIVE)
    output_router_logits: Optional[bool] = doc(
        "MoE: add router_aux_loss_coef x the load-balancing loss to the training loss (transformers' "
        "output_router_logits); None = the model's own (off in transformers' defaults). Router health "
        "(router_aux_loss, expert_share_max_over_mean) is logged either way.", None)
    zero3_leaf_modules: Optional[list[str]] = doc(
        "ZeRO-3 leaf modules (DeepSpeed set_z3_leaf_modules): class names whose parameters are gathered whole on "
        "entry, so ranks that route tokens to different experts gather alike; None = the MoE blocks found in the "
        "model (the modules that own a router), [] = none. A name matching no module is an error.", None)
    vocab_size: int = doc("Vocabulary size (the tokenizer must not exceed it).", 32000, kind=COUNT)
    max_position_embeddings: int = doc("Longest sequence the model supports.", 4096, kind=COUNT)
    tie_word_embeddings: bool = doc("Share input embedding and LM head weights.", False)
    rope_theta: float = doc("RoPE base frequency.", 10000.0, kind=POSITIVE)
    tokenizer: Optional[str] = doc("Tokenizer directory or hub id; None uses name_or_path.", None)
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = doc(
        "Attention kernel; 'auto' = flash_attention_2 when flash-attn and CUDA are present, else sdpa.", "auto")
    liger: bool = doc("Apply Liger kernels (CUDA + liger-kernel only; a one-line warning elsewhere).", False)
    gradient_checkpointing: bool = doc("Recompute activations in backward (transformers gradient checkpointing).", False)
    tiled_mlp: int = doc("Run each MLP in this many tiles along the sequence (DeepSpeed ALST's TiledMLP: a long "
                         "sequence never holds the whole MLP activation; each tile is recomputed in backward); "
                         "0 = off.", 0, kind=COUNT_OR_ZERO)
    tiled_logits: Optional[int] = doc(
        "Compute the LM head and loss in this many tiles along the sequence (DeepSpeed ALST's TiledFusedLogitsLoss: "
        "the vocabulary projection never holds a whole micro-batch's logits); None = auto: on for long sequences, "
        "those whose fp32 logits on one rank pass 4 GiB (seq_len / sequence_parallel_size x vocab_size >= 2^30: "
        "8,372 tokens at Llama-3's 128k vocabulary), with a tile per GiB; 0 or 1 = off. Not with fp16 or tied "
        "embeddings.", None, kind=COUNT_OR_ZERO)
    trust_remote_code: bool = doc("Allow model/tokenizer code from the hub repo to run (off unless asked).", False)
    init_std: float = doc(
        "Std of the normal init for from-scratch weights (transformers' initializer_range).", 0.02, kind=POSITIVE)
    lora: LoraConfig = doc("LoRA fine-tuning through PEFT.", factory=LoraConfig)


@dataclass
class SourceConfig:
    path: str = doc("A prepared directory (python -m trainer prepare-data), a local file/directory, or a hub name.", "")
    weight: float = doc(
        "Share of the training samples drawn from this source (weights are normalised).", 1.0, kind=NONNEGATIVE)
    name: Optional[str] = doc("Name in logs and eval metrics (default: the path's last component, without its "
                              "suffix); distinct for every source.", None)

    def shown_name(self) -> str:
        """The name logs, eval metrics and cached files use for this source."""
        return self.name or Path(self.path).stem or self.path


@dataclass
class DataConfig:
    task: Literal["pretrain", "sft", "preference", "grpo"] = doc(
        "pretrain: packed causal LM on raw text; sft: loss on responses only; preference: chosen/rejected pairs "
        "trained with the `preference` section's loss (DPO, IPO); grpo: RL on prompts (JSONL prompt + answer) with "
        "the `grpo` section's rewards (docs/rl.md).", "pretrain")
    source: str = doc("A prepared directory, a local .jsonl/.json/.parquet/.txt file or directory, or a hub "
                      "dataset name; training reads prepared token shards (see prepare-data).", "")
    sources: list[SourceConfig] = doc("Several sources blended by weight (instead of data.source); each keeps "
                                      "its own eval split.", factory=list)
    cache_dir: Optional[str] = doc("Where sources are prepared (default ~/.cache/deepspeed-preset-trainer/"
                                   "prepared), one directory per source + tokenizer + settings.", None)
    trust_shared_cache: bool = doc("Use entries of data.cache_dir that another user owns (a cache shared with people "
                                   "you trust); off: such an entry is refused, since whoever can write it chooses what "
                                   "the run trains on. Sizes and SHA-256s are checked either way.", False)
    auto_prepare_max_gb: float = doc("Local sources up to this size are prepared on first use by rank 0; "
                                     "larger ones and hub datasets need `python -m trainer prepare-data`.", 1.0,
                                     kind=GIGABYTES)
    split_seed: int = doc("Seed of the eval split (whole documents held out); part of the prepared data.", 0, kind=SEED)
    split: str = doc("Split of a hub dataset to read (slices work: 'train[:10%]').", "train")
    subset: Optional[str] = doc("Configuration of a hub dataset (datasets.load_dataset's name, e.g. sample-10BT).", None)
    eval_source: Optional[str] = doc("Separate eval data; None carves eval_fraction out of `source`.", None)
    eval_split: Optional[str] = doc("Split of a hub eval_source to read; None = the same as `split`.", None)
    eval_fraction: float = doc(
        "Share of records (documents) held out for eval when eval_source is None.", 0.05, kind=FRACTION)
    seq_len: int = doc("Tokens per training sequence.", 2048, kind=SEQUENCE_TOKENS)
    packing: bool = doc("Concatenate samples into full seq_len blocks (always on for pretrain).", True)
    cross_document_attention: Optional[bool] = doc(
        "Let a token attend to earlier documents of its packed sequence; off = each document attends only to itself "
        "(position ids restart, block-diagonal attention). None = auto: on for pretrain (a window of the token "
        "stream, as GPT and Megatron train), off for packed SFT; not with preference data or unpacked SFT.", None)
    truncate: bool = doc("Cut records longer than seq_len; when off such records are an error. Preference pairs: "
                         "the prompt is cut from the left first (down to half of seq_len), then both responses "
                         "from the right; a prompt of seq_len tokens or more is always an error.", False)
    text_field: str = doc("Column with raw text (pretrain).", "text")
    prompt_field: str = doc("Column with the prompt (sft, prompt/response records).", "prompt")
    response_field: str = doc("Column with the response (sft, prompt/response records).", "response")
    messages_field: str = doc("Column with chat messages (sft, rendered with the chat template).", "messages")
    chosen_field: str = doc("Column with the preferred response (preference: a string, an assistant message or a "
                            "list of final messages).", "chosen")
    rejected_field: str = doc("Column with the dispreferred response (preference; the same forms as chosen).",
                              "rejected")
    answer_field: str = doc("Column with the reference answer the rewards check (grpo; a string or a number).",
                            "answer")
    chat_template: Optional[str] = doc(
        "Chat template for messages: chatml, llama-2, llama-3, zephyr (trainer/data/templates/) or a Jinja file "
        "(absolute or relative to the repo root); replaces the tokenizer's own and is exported with it, its markers "
        "added as special tokens; None keeps the tokenizer's.",
        None)
    num_workers: int = doc(
        "Processes for tokenization when a source is prepared (datasets.map num_proc).", 1, kind=COUNT)


@dataclass
class TrainConfig:
    RENAMED: ClassVar[dict] = {"eval_batches": "replaced by train.eval_sequences: the sequences of one evaluation, "
                                               "independent of the world size; eval_batches x micro_batch_size x "
                                               "data-parallel ranks gives the old set's size"}
    micro_batch_size: Union[int, str, None] = doc(
        "Sequences per rank per forward (DeepSpeed train_micro_batch_size_per_gpu).", None, kind=COUNT)
    grad_accum: Union[int, str, None] = doc(
        "Micro-batches per optimizer step (DeepSpeed gradient_accumulation_steps).", None, kind=COUNT)
    global_batch_size: Union[int, str, None] = doc(
        "Sequences per optimizer step across data-parallel ranks.", None, kind=COUNT)
    precision: Literal["bf16", "fp16", "fp32"] = doc("Training precision; fills DeepSpeed bf16/fp16 'auto'.", "bf16")
    lr: float = doc("Peak learning rate.", 3e-4, kind=POSITIVE)
    min_lr: float = doc("Learning rate at the end of decay (WarmupCosineLR: as a ratio of lr).", 0.0, kind=NONNEGATIVE)
    betas: tuple[float, float] = doc("Adam betas.", (0.9, 0.95), kind=FRACTION)
    eps: float = doc("Adam epsilon.", 1e-8, kind=POSITIVE)
    weight_decay: float = doc("Decoupled weight decay.", 0.1, kind=NONNEGATIVE)
    grad_clip: float = doc(
        "Global gradient-norm clip (DeepSpeed gradient_clipping); 0 disables.", 1.0, kind=NONNEGATIVE)
    warmup_steps: int = doc("Linear warmup steps.", 100, kind=COUNT_OR_ZERO)
    max_steps: int = doc("Optimizer steps to train.", 1000, kind=COUNT)
    epochs: Optional[float] = doc(
        "Passes over the training data, instead of max_steps (give one: a --set of either replaces the preset's "
        "other): resolved to max_steps = ceil(epochs x the prepared train split's sequences / global_batch_size), "
        "printed by show and at the start; None: max_steps says how long.", None, kind=POSITIVE)
    eval_every: int = doc("Evaluate every N optimizer steps (0 = only at the end).", 100, kind=COUNT_OR_ZERO)
    eval_sequences: int = doc("Sequences per evaluation: the first N of each eval split in a fixed order (all of it "
                              "when shorter), the same set at every world size and micro-batch.", 256, kind=COUNT)
    sample_prompts: list[str] = doc("Prompts completed greedily at every eval (metrics.jsonl `samples`, a wandb "
                                    "table); every rank takes part, so it works under ZeRO-3 and AutoTP.", factory=list,
                                    multiline=True)
    sample_max_new_tokens: int = doc("Tokens generated per sample prompt.", 32, kind=COUNT)
    save_every: int = doc("Checkpoint every N optimizer steps (0 = only at the end).", 500, kind=COUNT_OR_ZERO)
    keep_last: int = doc("Checkpoints of this run's history kept on disk (older ones are deleted; other histories are "
                         "set aside in checkpoints/abandoned/, never deleted).", 3, kind=COUNT)
    checkpoint_checksums: bool = doc("Record every checkpoint file's SHA-256 in COMPLETE and check it on resume "
                                     "(one read of the checkpoint, split across ranks); off: sizes only.", True)
    checkpoint_writer: str = doc("How DeepSpeed writes checkpoint files: 'torch' (torch.save), 'fast' (DeepSpeed's "
                                 "FAST writer over libaio) or 'decoupled' (FAST in a separate process); a checkpoint "
                                 "is COMPLETE only after every writer has finished. fast/decoupled need a GPU.",
                                 "torch")
    seed: int = doc("Seed for init, data order and dropout.", 1234, kind=SEED)
    output_dir: str = doc("Run directory: metrics.jsonl, config.resolved.yaml, checkpoints/, hf/.", "runs/default")
    resume: Optional[str] = doc("'auto' (newest complete checkpoint in output_dir), a checkpoint path, or None.", None)
    stop_after: Optional[int] = doc(
        "End this invocation after N optimizer steps (checkpoint saved) even before max_steps; resume later with "
        "--resume auto. For allocations shorter than the run.", None, kind=COUNT)
    export_hf: bool = doc("Write the final model in HF format (safetensors) to output_dir/hf.", True)
    export_merged: bool = doc("LoRA runs: also write base + adapter merged into one HF model in output_dir/hf_merged "
                              "(what serving engines load).", False)
    on_signal: Literal["checkpoint", "exit"] = doc(
        "On SIGTERM/SIGINT: finish the step, save and exit 0 ('checkpoint'), or finish the step and exit 0 without "
        "saving ('exit': when a save takes longer than the scheduler's grace period).", "checkpoint")
    dist_timeout_s: int = doc("Seconds a collective waits for the other ranks before the process group fails "
                              "(deepspeed.init_distributed timeout): how long a hung or dead rank can stall the rest.",
                              1800, kind=WHOLE_SECONDS)
    max_bad_steps: int = doc("Stop after this many consecutive non-finite (skipped) steps.", 3, kind=COUNT)
    spike_ratio: float = doc(
        "Warn when a step's loss exceeds this x its moving average (0 = off).", 3.0, kind=NONNEGATIVE)
    spike_window: int = doc("Steps in the loss moving average for spike detection.", 50, kind=COUNT)
    min_loss_scale_hits: int = doc(
        "fp16: report when the loss scale sits at min_loss_scale this many steps.", 10, kind=COUNT)


@dataclass
class LoggingConfig:
    log_every: int = doc("Log metrics every N optimizer steps.", 10, kind=COUNT)
    progress_bar: bool = doc("Show a progress bar on rank 0.", True)
    wandb_mode: Literal["disabled", "offline", "online"] = doc("wandb tracking mode; 'disabled' never imports wandb.", "disabled")
    wandb_project: Optional[str] = doc("wandb project.", None)
    wandb_entity: Optional[str] = doc("wandb entity (team or user).", None)
    run_name: Optional[str] = doc("Run name (wandb and logs); None = the preset name.", None)
    tags: list[str] = doc("wandb tags (preset:NAME, task:TASK and hw:NxGPU are added).", factory=list)
    wandb_log_model: bool = doc("Log the final HF export (train.export_hf) as a wandb artifact of type 'model' (wandb "
                                "stages a copy of the files until they are uploaded).", False)
    tensorboard: bool = doc("Also write the metrics as TensorBoard scalars to output_dir/tensorboard (the HF Trainer's "
                            "report_to habit); off: tensorboard is never imported.", False)


@dataclass
class PreferenceConfig:
    loss: Literal["sigmoid", "ipo"] = doc(
        "data.task=preference: 'sigmoid' is DPO (-log sigmoid(beta x margin), with label_smoothing the conservative "
        "cDPO mix); 'ipo' is (margin - 1/(2 beta))^2 on per-token mean log-ratios (as TRL and the IPO authors do).",
        "sigmoid")
    beta: float = doc("Strength of the pull towards the reference (DPO beta, IPO tau).", 0.1, kind=POSITIVE)
    label_smoothing: float = doc("sigmoid: assumed share of pairs whose preference is flipped (cDPO); below 0.5.",
                                 0.0, kind=FRACTION)
    reference: Literal["auto", "adapter", "engine", "precomputed"] = doc(
        "The frozen reference model: 'adapter' = the LoRA base with the adapter disabled (no second copy; needs "
        "model.lora.enabled), 'engine' = a second DeepSpeed engine without optimizer (ZeRO-3 when training is), "
        "'precomputed' = its log-probs computed once before training (by the adapter-disabled base for LoRA, else a "
        "temporary engine) and kept in data.cache_dir/reference-logps, keyed by the data and the reference's "
        "fingerprint; 'auto' = adapter for LoRA runs, else engine.", "auto")
    reference_offload: bool = doc("reference=engine under ZeRO-3: keep the reference's parameters in CPU memory.",
                                  False)


GRPO_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo")  # as TRL 1.13's GRPOConfig.loss_type names them
BUILTIN_REWARDS = ("exact_match", "format", "length_penalty")


@dataclass
class RewardSpec:
    name: str = doc("A built-in reward (exact_match, format, length_penalty) or your own function as "
                    "'package.module:function' (imported and run: docs/security.md).", "exact_match")
    weight: float = doc("Weight of this reward in the sum the advantages are computed from (TRL reward_weights).", 1.0,
                        kind=NONNEGATIVE)
    pattern: Optional[str] = doc("format: the regular expression a whole completion must match (re.fullmatch, "
                                 "DOTALL); None = the answer format of exact_match (a number, \\boxed{} or #### x).",
                                 None)
    target_tokens: int = doc("length_penalty: completions up to this many tokens are not penalised; each token "
                             "beyond costs 1/target_tokens (down to -1).", 64, kind=COUNT)


@dataclass
class GrpoConfig:
    rewards: list[RewardSpec] = doc("Reward functions, summed with their weights; exact_match's 0/1 is also logged as "
                                    "`accuracy`.", factory=lambda: [RewardSpec()])
    num_generations: int = doc("Completions sampled per prompt (the group G, at least 2); train.micro_batch_size "
                               "counts completions and is a multiple of it.", 8, kind=COUNT)
    max_new_tokens: int = doc("Longest completion in tokens; prompt + completion fit in data.seq_len.", 256,
                              kind=COUNT)
    temperature: float = doc("Sampling temperature of the rollouts (the loss divides the logits by it too, as TRL).",
                             1.0, kind=TEMPERATURE)
    top_p: float = doc("Nucleus sampling mass of the rollouts (1.0 = off).", 1.0, kind=PROBABILITY)
    top_k: int = doc("Sample among the k most likely tokens (0 = off).", 0, kind=COUNT_OR_ZERO)
    num_iterations: int = doc("Optimizer steps on each batch of rollouts (TRL num_iterations, mu): more than 1 keeps "
                              "the rollout-time log-probs and clips the ratio to them.", 1, kind=COUNT)
    beta: float = doc("KL coefficient to the reference model (0 = no reference: none is built).", 0.0,
                      kind=NONNEGATIVE)
    epsilon: float = doc("Clip range of the probability ratio (PPO epsilon), below and above 1.", 0.2, kind=FRACTION)
    epsilon_high: Optional[float] = doc("Upper clip range (DAPO's clip-higher); None = epsilon.", None, kind=POSITIVE)
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = doc(
        "How per-token losses are averaged, as TRL 1.13: grpo (per sequence, then mean), bnpo (over the micro-batch's "
        "tokens), dr_grpo (over micro-batch x max_new_tokens), dapo (over the step's tokens on every rank).", "dapo")
    scale_rewards: Literal["group", "batch", "none"] = doc(
        "Divide advantages by the std of the group's rewards, of the whole step's, or not at all (Dr. GRPO).", "group")
    eval_greedy: bool = doc("Evaluation completes each eval prompt once, greedily (off: sampled as in training).", True)


@dataclass
class Config:
    name: str = doc("Preset name (the file stem).", "")
    description: str = doc("One line: model, hardware, what it trades off.", "")
    deepspeed_template: Optional[str] = doc("Shared DeepSpeed JSON under presets/deepspeed/ that `deepspeed` overrides.", None)
    hardware: HardwareConfig = doc("Where it runs.", factory=HardwareConfig)
    model: ModelConfig = doc("What is trained.", factory=ModelConfig)
    data: DataConfig = doc("What it is trained on.", factory=DataConfig)
    train: TrainConfig = doc("How long, how fast, where results go.", factory=TrainConfig)
    deepspeed: dict = doc("DeepSpeed config as DeepSpeed documents it; 'auto' values are filled from train/model.", factory=dict)
    logging: LoggingConfig = doc("Metrics and experiment tracking.", factory=LoggingConfig)
    preference: PreferenceConfig = doc("Preference tuning (data.task=preference): the loss and the reference model.",
                                       factory=PreferenceConfig)
    grpo: GrpoConfig = doc("RL post-training (data.task=grpo): rewards, sampling and the clipped policy-gradient loss "
                           "(docs/rl.md).", factory=GrpoConfig)

