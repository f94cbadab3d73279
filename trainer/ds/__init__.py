"""The only code that reads or writes DeepSpeed config keys.

Callers import the package, `from trainer import ds as dsc`, and ask by name (`dsc.zero_stage(ds)`,
`dsc.zero_block(3, offload_optimizer="cpu")`), so a DeepSpeed key rename is a change in one place:

- `keys`: accessors, what a config says (stage, offload devices, precision, buckets, ...);
- `build`: configs and `--set` overrides written from intent (planner, doctor, lint, rehearsal);
- `batch`: the batch triad (micro x accumulation x data-parallel = global), solved once;
- `auto`: "auto" filled from the trainer's sections, as the HF Trainer fills it;
- `check`: the keys the installed DeepSpeed reads, learned from that DeepSpeed (`learned`: once per DeepSpeed,
  cached on disk, so checking a config imports neither DeepSpeed nor torch; `spec`: its pydantic models as JSON and
  back; `probe`: the dict that watches DeepSpeed parse);
- `inference`: the ZeRO-Inference config (stage 3, parameters offloaded, no optimizer);
- `autotuning`: DeepSpeed's autotuner: its tuning config, its experiments as `--set` items, its best config;
- `ops`: the JIT-built ops a config makes DeepSpeed load (what setup.sh builds ahead).
"""
from .auto import fill_auto, find_auto, scheduler_start
from .autotuning import (
    autotuning_block, decode_launcher_config, experiment_configs, experiment_overrides, preset_section, tuning_config,
    without_autotuning,
)
from .batch import Batch, accumulation, solve_batch
from .build import (
    AUTO_BUCKETS, CHECKPOINT_WRITERS, USEFUL_BUCKET, activation_checkpointing_overrides, bucket_floor_overrides,
    bucket_overrides,
    with_bucket_floor, aio_defaults, base_config, client_optimizer_on_cpu_override,
    frozen_reference_config, frozen_reference_placement, gather_on_save_override, global_batch_overrides,
    min_loss_scale_override, precision_overrides, rehearsal_changes,
    set_override, smaller_stage3_buffers, torch_adam_on_cpu_overrides, unpinned_offload_overrides,
    with_checkpoint_writer, with_expert_parallel, with_sequence_parallel, with_universal_load,
    with_zero3_leaf_classes, with_zeropp, without_cpu_checkpointing,
    zero_block, zero_overrides,
)
from .check import REMOVED_OPTIMIZERS, check_keys
from .inference import (
    PARAM_BUFFER_COUNT, PERSISTENCE_THRESHOLD, init_inference_config, nvme_buffer_size, zero_inference_config,
)
from .keys import (
    aio_block, autoep_size, autotp_size, bf16_enabled, contiguous_gradients, cpu_checkpointing, expert_parallel, forces_ds_cpu_optimizer,
    fp16_enabled, fp16_min_loss_scale, gather_16bit_on_save, has_activation_checkpointing, has_pipeline, hpz_partition_size,
    leaf_paths, micro_batch_size, nvme_offloads, nvme_pipelined, offload_block, offload_optimizer_device,
    offload_param_device, offload_pin_memory, overlap_comm, precision, quantized_gradients, quantized_weights,
    scheduler_type, sequence_parallel_size, without_tensor_parallel, zero, zero3_leaf_block, zero_key, zero_setting,
    zero_stage,
)
from .ops import jit_ops, optimizer_ops

__all__ = [
    "AUTO_BUCKETS", "Batch", "CHECKPOINT_WRITERS", "USEFUL_BUCKET", "bucket_floor_overrides", "bucket_overrides",
    "with_bucket_floor",
    "PARAM_BUFFER_COUNT", "PERSISTENCE_THRESHOLD", "REMOVED_OPTIMIZERS",
    "accumulation", "activation_checkpointing_overrides", "aio_block", "aio_defaults", "autoep_size", "autotp_size",
    "autotuning_block", "base_config", "bf16_enabled", "check_keys", "client_optimizer_on_cpu_override",
    "contiguous_gradients", "cpu_checkpointing", "decode_launcher_config", "expert_parallel", "experiment_configs", "experiment_overrides", "fill_auto",
    "find_auto", "forces_ds_cpu_optimizer", "fp16_enabled", "frozen_reference_config", "frozen_reference_placement", "fp16_min_loss_scale",
    "gather_16bit_on_save", "gather_on_save_override", "global_batch_overrides", "has_activation_checkpointing",
    "has_pipeline", "hpz_partition_size",
    "init_inference_config", "jit_ops", "leaf_paths", "micro_batch_size", "min_loss_scale_override", "nvme_buffer_size",
    "nvme_offloads", "nvme_pipelined", "offload_block", "offload_optimizer_device", "offload_param_device",
    "offload_pin_memory", "optimizer_ops", "overlap_comm", "precision", "precision_overrides", "preset_section",
    "quantized_gradients", "quantized_weights", "rehearsal_changes", "scheduler_start", "scheduler_type",
    "sequence_parallel_size", "set_override",
    "smaller_stage3_buffers", "solve_batch", "torch_adam_on_cpu_overrides", "tuning_config",
    "unpinned_offload_overrides", "with_checkpoint_writer", "with_expert_parallel", "with_sequence_parallel",
    "with_universal_load",
    "with_zeropp", "without_cpu_checkpointing", "with_zero3_leaf_classes", "without_autotuning", "without_tensor_parallel", "zero",
    "zero3_leaf_block", "zero_block", "zero_inference_config", "zero_key",
    "zero_overrides", "zero_setting", "zero_stage",
]
