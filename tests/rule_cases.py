"""One table of cross-field checks: for each, the `--set` overrides that break the shipped tiny_cpu preset
(2 CPU ranks, ZeRO-2, fp32), what the message must say (the key and the fix), and the overrides that fix it.

Every rule in trainer.rules.RULES has a row, named after it; a row named after a check that lives elsewhere
says where. test_validation runs the table through `resolve()`, test_bad_input through the CLI.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Case:
    breaks: list[str]              # --set overrides on tiny_cpu that trip the check
    says: list[str]                # fragments one reported problem must all contain
    fix: Optional[list[str]]       # overrides (after `breaks`) that resolve cleanly; None: no fix to try
    where: str = "rules"           # the module holding the check


ZERO = "deepspeed.zero_optimization"
PREFERENCE = ["data.task=preference", f"data.source={ROOT / 'data' / 'tiny' / 'preference.jsonl'}"]
GRPO_DATA = ["data.task=grpo", f"data.source={ROOT / 'data' / 'tiny_grpo' / 'train.jsonl'}"]
GRPO = [*GRPO_DATA, "grpo.max_new_tokens=8"]

CASES = {
    "offload_param_needs_stage3": Case(
        [f"{ZERO}.offload_param={{device: cpu}}"],
        [f"{ZERO}.offload_param needs stage 3", "silently ignore", "stage=3 or remove offload_param"],
        [f"{ZERO}.stage=3"]),
    "offload_optimizer_needs_zero": Case(
        [f"{ZERO}.stage=0", f"{ZERO}.offload_optimizer={{device: cpu}}"],
        [f"{ZERO}.offload_optimizer needs ZeRO stage 1, 2 or 3", "stage is 0"],
        [f"{ZERO}.stage=1"]),
    "nvme_offload": Case(
        [f"{ZERO}.offload_optimizer={{device: nvme, nvme_path: {ROOT}}}"],
        ["offload_optimizer.device=nvme needs stage 3", "stage=3 or device=cpu"],
        [f"{ZERO}.stage=3"]),
    "autotp_size_divides_the_world": Case(
        ["deepspeed.tensor_parallel={autotp_size: 3}"],
        ["deepspeed.tensor_parallel.autotp_size=3 must divide the world size 2", "choose a divisor"],
        ["deepspeed.tensor_parallel={autotp_size: 2}"], where="ds.batch"),
    "bf16_needs_hardware": Case(
        ["hardware.gpu=v100-32g", "train.precision=bf16"],
        ["bf16 is enabled", "V100", "has no bf16", "train.precision=fp16"],
        ["hardware.gpu=a100-80g"]),
    "one_half_precision_only": Case(
        ["hardware.gpu=a100-80g", "train.precision=bf16", "deepspeed.bf16={enabled: true}",
         "deepspeed.fp16={enabled: true}"],
        ["deepspeed.fp16.enabled=True", "disagrees", "'auto'"],
        ["deepspeed.fp16=null"], where="ds.auto"),
    "cpu_ranks_precision": Case(
        ["train.precision=fp16", "deepspeed.bf16=null", "deepspeed.fp16={enabled: auto}"],
        ["fp16 is enabled on CPU ranks", "train.precision=fp32"],
        ["train.precision=fp32"]),
    "round_robin_needs_stage_1_2": Case(
        [f"{ZERO}.stage=3", f"{ZERO}.round_robin_gradients=true"],
        [f"{ZERO}.round_robin_gradients only works at stage 1/2", "stage is 3", "remove it"],
        [f"{ZERO}.stage=2"]),
    "engine_build_constraints": Case(
        [f"{ZERO}.allgather_bucket_size=3", "deepspeed.steps_per_print=0"],
        [f"{ZERO}.allgather_bucket_size=3", "positive multiple of 2"],
        ["deepspeed.steps_per_print=10", f"{ZERO}.allgather_bucket_size=500000000"]),
    "zeropp_needs_stage3": Case(
        [f"{ZERO}.zero_quantized_gradients=true"],
        ["ZeRO++ (zero_quantized_gradients) needs stage 3", "set zero_optimization.stage=3"],
        [f"{ZERO}.stage=3"]),
    "hpz_divides_world": Case(
        ["hardware.gpu=a100-80g", "hardware.gpus_per_node=4", "train.precision=bf16", f"{ZERO}.stage=3",
         f"{ZERO}.zero_hpz_partition_size=3"],
        [f"{ZERO}.zero_hpz_partition_size=3 must divide the world size 4", "GPUs per node, 4"],
        [f"{ZERO}.zero_hpz_partition_size=2"]),
    "quantized_weights_need_gpu": Case(
        [f"{ZERO}.stage=3", f"{ZERO}.zero_quantized_weights=true"],
        [f"{ZERO}.zero_quantized_weights is not implemented", "CPU", "turn it off"],
        [f"{ZERO}.zero_quantized_weights=false"]),
    "checkpoint_writer_known_and_runnable": Case(
        ["train.checkpoint_writer=decoupled"],
        ["train.checkpoint_writer=decoupled does not run on CPU", "FAST writer", "train.checkpoint_writer=torch"],
        ["train.checkpoint_writer=torch"]),
    "ds_checkpointing_needs_model_flag": Case(
        ["deepspeed.activation_checkpointing={partition_activations: false}"],
        ["deepspeed.activation_checkpointing is set but model.gradient_checkpointing is false",
         "set model.gradient_checkpointing=true"],
        ["model.gradient_checkpointing=true"]),
    "min_lr_needs_cosine": Case(
        ["train.min_lr=1e-4"],
        ["train.min_lr=0.0001", "WarmupCosineLR", "WarmupDecayLR", "train.min_lr=0"],
        ["train.min_lr=0"]),
    "lora_needs_pretrained_weights": Case(
        ["model.lora.enabled=true"],
        ["model.lora.enabled needs pretrained weights", "model.name_or_path"],
        None, where="resolve.check_values"),
    "autotp_shards_heads": Case(
        ["deepspeed.tensor_parallel={autotp_size: 2}", "model.num_kv_heads=1"],
        ["deepspeed.tensor_parallel.autotp_size=2 cannot shard model.num_heads=4 and num_kv_heads=1",
         "use one of [1]"],
        ["model.num_kv_heads=2"]),
    "sequence_parallel_size_divides_the_world": Case(
        ["deepspeed.sequence_parallel_size=3"],
        ["deepspeed.sequence_parallel_size=3 must divide the world size 2", "use one of [1, 2]"],
        ["deepspeed.sequence_parallel_size=2"], where="ds.batch"),
    "sequence_parallel_size_is_a_count": Case(
        ["deepspeed.sequence_parallel_size=two"],
        ["deepspeed.sequence_parallel_size: 'two' must be a whole number of ranks"],
        ["deepspeed.sequence_parallel_size=1"], where="ds.batch"),
    "sequence_parallel_not_with_autotp": Case(
        ["deepspeed.sequence_parallel_size=2", "deepspeed.tensor_parallel={autotp_size: 2}"],
        ["deepspeed.sequence_parallel_size=2 with deepspeed.tensor_parallel.autotp_size=2", "drop one",
         "deepspeed.tensor_parallel=null"],
        ["deepspeed.tensor_parallel=null"], where="ds.batch"),
    "sequence_parallel_shards_heads": Case(
        ["hardware.gpus_per_node=6", "deepspeed.sequence_parallel_size=3"],
        ["deepspeed.sequence_parallel_size=3 cannot split model.num_heads=4 and num_kv_heads=2", "use one of [1, 2]"],
        ["deepspeed.sequence_parallel_size=2"]),
    "sequence_parallel_divides_seq_len": Case(
        ["deepspeed.sequence_parallel_size=2", "data.seq_len=127"],
        ["data.seq_len=127 is not divisible by deepspeed.sequence_parallel_size=2", "use data.seq_len=126"],
        ["data.seq_len=128"]),
    "sequence_parallel_supported": Case(
        ["deepspeed.sequence_parallel_size=2", "model.attn_implementation=eager"],
        ["deepspeed.sequence_parallel_size=2 needs model.attn_implementation sdpa", "refuses 'eager'"],
        ["model.attn_implementation=sdpa"]),
    "sequence_parallel_without_pipeline": Case(
        ["deepspeed.sequence_parallel_size=2", "deepspeed.pipeline={stages: 2}"],
        ["deepspeed.sequence_parallel_size=2 with a deepspeed.pipeline block", "remove deepspeed.pipeline"],
        ["deepspeed.pipeline=null"], where="rules.sequence_parallel_supported"),
    "sequence_parallel_without_sample_prompts": Case(
        ["deepspeed.sequence_parallel_size=2", "train.sample_prompts=[hello]"],
        ["deepspeed.sequence_parallel_size=2 with train.sample_prompts", "train.sample_prompts=[]"],
        ["train.sample_prompts=[]"], where="rules.sequence_parallel_supported"),
    "sequence_parallel_without_preference": Case(
        ["deepspeed.sequence_parallel_size=2", "data.task=preference", "data.source=data/tiny/preference.jsonl"],
        ["deepspeed.sequence_parallel_size=2 with data.task=preference", "deepspeed.sequence_parallel_size=1"],
        ["deepspeed.sequence_parallel_size=1"], where="rules.sequence_parallel_supported"),
    "tiled_logits_supported": Case(
        ["hardware.gpu=v100-32g", "train.precision=fp16", "deepspeed.bf16=null", "deepspeed.fp16={enabled: auto}",
         "model.tiled_logits=4"],
        ["model.tiled_logits=4 with fp16", "loss scale never reaches it", "model.tiled_logits=0"],
        ["model.tiled_logits=0"]),
    "tiled_logits_without_tied_embeddings": Case(
        ["model.tiled_logits=4", "model.tie_word_embeddings=true"],
        ["model.tiled_logits=4 with model.tie_word_embeddings", "Gradient computed twice", "model.tiled_logits=0"],
        ["model.tiled_logits=0"], where="rules.tiled_logits_supported"),
    "tiled_logits_without_preference": Case(
        ["model.tiled_logits=4", "data.task=preference", "data.source=data/tiny/preference.jsonl"],
        ["model.tiled_logits=4 with data.task=preference", "set model.tiled_logits=0"],
        ["model.tiled_logits=0"], where="rules.tiled_logits_supported"),
    "lora_targets_exist": Case(
        ["model.lora.enabled=true", "model.name_or_path=meta-llama/Llama-2-7b-hf", "model.lora.target_modules=[q_proj, qproj]"],
        ["model.lora.target_modules: 'qproj' names no module", "did you mean 'q_proj'?"],
        ["model.lora.target_modules=[q_proj, v_proj]"]),
    "model_family_buildable": Case(
        ["model.family=mixtrall", "model.num_experts=4"],
        ["model.family 'mixtrall' is not a family", "did you mean 'mixtral'?", "supported: llama, mistral, qwen2, "
         "mixtral, qwen3_moe"],
        ["model.family=mixtral"]),
    "expert_parallel_fits": Case(
        ["model.family=mixtral", "model.num_experts=6", "deepspeed.expert_parallel={enabled: true, autoep_size: 4}"],
        ["deepspeed.expert_parallel.autoep_size=4 must divide the world size 2", "use one of [1, 2]"],
        ["deepspeed.expert_parallel={enabled: true, autoep_size: 2}"]),
    "expert_parallel_enabled_is_a_bool": Case(
        ["model.family=mixtral", "model.num_experts=4", "deepspeed.expert_parallel={enabled: 'no', autoep_size: 2}"],
        ["deepspeed.expert_parallel.enabled: 'no' must be true or false"],
        ["deepspeed.expert_parallel={enabled: true, autoep_size: 2}"], where="ds.check"),
    "expert_parallel_flags_are_bools": Case(
        ["model.family=mixtral", "model.num_experts=4",
         "deepspeed.expert_parallel={enabled: true, autoep_size: 2, use_grouped_mm: 'no'}"],
        ["deepspeed.expert_parallel.use_grouped_mm: 'no' must be true or false"],
        ["deepspeed.expert_parallel={enabled: true, autoep_size: 2, use_grouped_mm: false}"], where="ds.check"),
    "moe_keys_on_a_pretrained_dense_model": Case(
        ["model.name_or_path=meta-llama/Llama-2-7b-hf", "model.num_experts=8"],
        ["model.num_experts: MoE settings, but the pretrained model's model_type llama is a dense family"],
        ["model.num_experts=null"], where="rules.model_family_buildable"),
    "tiled_mlp_has_dense_mlps": Case(
        ["model.family=mixtral", "model.num_experts=4", "model.tiled_mlp=4"],
        ["model.tiled_mlp=4 with the MoE model mixtral", "set model.tiled_mlp=0"],
        ["model.tiled_mlp=0"]),
    "cross_document_attention_applies": Case(
        [*PREFERENCE, "data.cross_document_attention=false"],
        ["data.cross_document_attention=False with data.task=preference", "preference pairs are never packed",
         "remove the setting"],
        ["data.cross_document_attention=null"]),
    "cross_document_attention_on_unpacked_sft": Case(
        ["data.task=sft", f"data.source={ROOT / 'data' / 'tiny' / 'sft.jsonl'}", "data.packing=false",
         "data.cross_document_attention=true"],
        ["data.cross_document_attention=True with data.task=sft", "data.packing=false puts one document in each"],
        ["data.packing=true"], where="rules.cross_document_attention_applies"),
    "preference_settings": Case(
        ["preference.beta=0.5"],
        ["preference.beta set, but data.task=pretrain", "set data.task=preference or remove it"],
        [*PREFERENCE]),
    "preference_label_smoothing_below_half": Case(
        [*PREFERENCE, "preference.label_smoothing=0.5"],
        ["preference.label_smoothing=0.5", "use a value below 0.5"],
        ["preference.label_smoothing=0.1"], where="rules.preference_settings"),
    "preference_label_smoothing_only_with_sigmoid": Case(
        [*PREFERENCE, "preference.loss=ipo", "preference.label_smoothing=0.1"],
        ["preference.label_smoothing=0.1 with preference.loss=ipo", "label_smoothing=0 or loss=sigmoid"],
        ["preference.label_smoothing=0"], where="rules.preference_settings"),
    "preference_columns_differ": Case(
        [*PREFERENCE, "data.rejected_field=chosen"],
        ["data.chosen_field='chosen' is also data.rejected_field", "name the column that holds each"],
        ["data.rejected_field=rejected"], where="rules.preference_settings"),
    "preference_adapter_needs_lora": Case(
        [*PREFERENCE, "preference.reference=adapter"],
        ["preference.reference=adapter", "model.lora.enabled is false", "preference.reference=engine"],
        ["preference.reference=engine"], where="rules.preference_settings"),
    "preference_reference_offload_needs_an_engine_at_stage3": Case(
        [*PREFERENCE, "preference.reference_offload=true"],
        ["preference.reference_offload", "stage is 2", "deepspeed.zero_optimization.stage=3"],
        [f"{ZERO}.stage=3"], where="rules.preference_settings"),
    "grpo_settings": Case(
        ["grpo.num_generations=4"],
        ["grpo.num_generations set, but data.task=pretrain", "set data.task=grpo or remove it"],
        [*GRPO, "grpo.num_generations=4"]),
    "grpo_needs_a_group": Case(
        [*GRPO, "grpo.num_generations=1"],
        ["grpo.num_generations=1", "use at least 2"],
        ["grpo.num_generations=2"], where="rules.grpo_settings"),
    "grpo_whole_groups_per_micro_batch": Case(
        [*GRPO, "grpo.num_generations=3"],
        ["train.micro_batch_size=8 counts completions", "multiple of it"],
        ["grpo.num_generations=4"], where="rules.grpo_settings"),
    "grpo_room_for_a_prompt": Case(
        [*GRPO_DATA, "grpo.max_new_tokens=128"],
        ["grpo.max_new_tokens=128 leaves no room for a prompt", "raise data.seq_len"],
        ["grpo.max_new_tokens=64"], where="rules.grpo_settings"),
    "zero3_leaf_modules_need_stage3": Case(
        ["model.zero3_leaf_modules=[LlamaMLP]"],
        ["model.zero3_leaf_modules only matters at ZeRO stage 3", "stage is 2", "zero_optimization.stage=3"],
        [f"{ZERO}.stage=3"]),
    "legacy_cpu_offload_key": Case(
        [f"{ZERO}.cpu_offload=true"],
        [f"{ZERO}.cpu_offload: deprecated", "honours it", "offload_optimizer: {device: cpu}"],
        [f"{ZERO}.cpu_offload=null", f"{ZERO}.offload_optimizer={{device: cpu}}"], where="ds.check"),
    "legacy_cpu_offload_param_key": Case(
        [f"{ZERO}.stage=3", f"{ZERO}.cpu_offload_param=true"],
        [f"{ZERO}.cpu_offload_param: deprecated", "offload_param: {device: cpu}"],
        [f"{ZERO}.cpu_offload_param=null"], where="ds.check"),
    "non_finite_deepspeed_value": Case(
        ["deepspeed.gradient_clipping=.inf"],
        ["deepspeed.gradient_clipping: inf is not a finite number", "JSON has no inf/nan"],
        ["deepspeed.gradient_clipping=1.0"], where="ds.check"),
}
