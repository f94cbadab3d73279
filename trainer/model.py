"""Build the model the resolved config asks for: transformers causal LM, ZeRO-3 sharded construction,
attention kernel, Liger, gradient checkpointing, LoRA.

From-scratch initialisation is a pure function of (seed, parameter name): every parameter is drawn
from its own generator seeded by its name, on the full (unsharded) shape, and copied in. So the
same seed gives the same weights at every ZeRO stage, world size and partitioning: switching stage
after an OOM does not change the experiment. Under ZeRO-3, plain `zero.Init` would skip transformers'
init and transformers' own ZeRO-3 init draws different numbers; gathering each parameter and
filling it by name avoids both (see ../shared/notes/deepspeed.md).
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
from typing import Any

import torch

from . import ds as dsc
from . import moe
from .config import Config, ModelConfig
from .errors import UserError
from .remote_code import load_kwargs, refused


log = logging.getLogger(__name__)


def hf_config(model_cfg: ModelConfig, attn_implementation: str):
    """A transformers config for the inline architecture (from-scratch training)."""
    from transformers import AutoConfig
    return AutoConfig.for_model(
        model_cfg.family,
        hidden_size=model_cfg.hidden_size,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_heads,
        num_key_value_heads=model_cfg.num_kv_heads or model_cfg.num_heads,
        intermediate_size=model_cfg.intermediate_size,
        vocab_size=model_cfg.vocab_size,
        max_position_embeddings=model_cfg.max_position_embeddings,
        tie_word_embeddings=model_cfg.tie_word_embeddings,
        rope_theta=model_cfg.rope_theta,
        initializer_range=model_cfg.init_std,
        attn_implementation=attn_implementation,
        use_cache=False,
        **moe.moe_config_fields(model_cfg),
    )


def flash_attention_available() -> bool:
    """Whether transformers will run flash_attention_2 here, by its own test (is_flash_attn_2_available: the
    flash-attn distribution, version >= 2.3.3, and CUDA). A bare `flash_attn` module that transformers rejects
    (another distribution, an older version) would otherwise turn the promised sdpa fallback into an ImportError
    or a hub-kernel download at from_pretrained; the GPU check and the GPU tests ask this same function."""
    from transformers.utils import is_flash_attn_2_available
    return bool(is_flash_attn_2_available())


def choose_attention(model_cfg: ModelConfig) -> str:
    """'auto' -> flash_attention_2 when transformers can run flash-attn here (flash_attention_available), else sdpa."""
    wanted = model_cfg.attn_implementation
    flash_ok = flash_attention_available()
    if wanted == "auto":
        return "flash_attention_2" if flash_ok else "sdpa"
    if wanted == "flash_attention_2" and not flash_ok:
        log.warning("flash_attention_2 needs CUDA and the flash-attn package (>= 2.3.3, as transformers checks it); "
                    "using sdpa instead")
        return "sdpa"
    return wanted


def training_dtype(ds: dict) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dsc.precision(ds)]


def build_model(cfg: Config, rank: int, tokens: int = 0) -> tuple[torch.nn.Module, Any]:
    """The model, ready for deepspeed.initialize, plus the HfDeepSpeedConfig that must stay referenced
    while transformers builds/loads under ZeRO-3 (None otherwise). `tokens`: the tokenizer's size, which a
    pretrained model's embeddings grow to (fit_embeddings)."""
    from transformers import AutoModelForCausalLM
    ds, model_cfg = cfg.deepspeed, cfg.model
    attention = choose_attention(model_cfg)
    hf_ds_config = _zero3_integration(ds)
    maybe_apply_liger(model_cfg, dsc.zero_stage(ds))
    if model_cfg.name_or_path:
        model = pretrained(model_cfg, attention, training_dtype(ds))
        fit_embeddings(model, tokens, rank)
    else:
        model = AutoModelForCausalLM.from_config(hf_config(model_cfg, attention))
        init_weights_by_name(model, cfg.train.seed, model_cfg.init_std, rank)
    model.config.use_cache = False  # a KV cache is useless in training and costs time every forward
    scope_liger_loss(model, dsc.zero_stage(ds))
    mark_zero3_leaves(model, cfg)
    if model_cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model, ds)
    if model_cfg.lora.enabled:
        model = apply_lora(model, model_cfg)
    return model, hf_ds_config


def pretrained(model_cfg: ModelConfig, attention: str, dtype: torch.dtype):
    """model.name_or_path's weights; its own code runs only when the preset allows it (model.trust_remote_code)."""
    from transformers import AutoModelForCausalLM
    path = model_cfg.name_or_path
    try:
        return AutoModelForCausalLM.from_pretrained(path, attn_implementation=attention, dtype=dtype,
                                                    **moe.router_settings(model_cfg), **load_kwargs(model_cfg.trust_remote_code, path, "model"))
    except ValueError as err:
        code = refused(err, path, "set model.trust_remote_code=true in the preset (or --set "
                                  "model.trust_remote_code=true)")
        if code:
            raise code from None
        raise


def fit_embeddings(model, tokens: int, rank: int = 0) -> int:
    """Input and output embeddings grown to `tokens` rows when the tokenizer has more (a chat template's markers
    added as special tokens: trainer/data/chat_format.py), as TRL's setup_chat_format does; the new rows start at
    the mean of the old ones (transformers' resize; under ZeRO-3 it gathers the partitioned embeddings itself).
    Returns the rows added."""
    rows = model.get_input_embeddings().weight
    have = getattr(rows, "ds_shape", rows.shape)[0]
    if tokens <= have:
        return 0
    model.resize_token_embeddings(tokens)
    if rank == 0:
        log.warning("the tokenizer has %d tokens, the model's embeddings %d rows: grown to %d (new rows start at the "
                    "mean of the old ones)", tokens, have, tokens)
    return tokens - have


def _zero3_integration(ds: dict):
    """Under ZeRO-3, transformers builds/loads the model sharded (zero.Init) while this object lives.
    It gets the config without `tensor_parallel`: transformers 5.x refuses sharded loading with it."""
    if dsc.zero_stage(ds) != 3:
        return None
    from transformers.integrations.deepspeed import HfDeepSpeedConfig
    return HfDeepSpeedConfig(dsc.without_tensor_parallel(ds))


def mark_zero3_leaves(model: torch.nn.Module, cfg: Config) -> None:
    """Under ZeRO-3, the MoE blocks (or model.zero3_leaf_modules) become ZeRO-3 leaf modules; names that match no
    module are an error at every stage, before any step. A config with its own DeepSpeed leaf_module block is left
    to DeepSpeed (the rules refuse it together with model.zero3_leaf_modules)."""
    if dsc.zero3_leaf_block(cfg.deepspeed) is not None:
        return
    classes = moe.zero3_leaf_classes(model, cfg.model.zero3_leaf_modules)
    if dsc.expert_parallel(cfg.deepspeed).get("enabled"):
        return  # AutoEP replaces the MoE blocks by its own layers, whose experts each rank owns: nothing to flag
    if dsc.zero_stage(cfg.deepspeed) == 3 and classes:
        moe.mark_zero3_leaves(model, classes)


def zero3_leaf_config(model: torch.nn.Module, ds: dict) -> dict:
    """The engine's DeepSpeed config naming exactly the leaf modules the model carries (mark_zero3_leaves), so
    DeepSpeed's default leaf list adds none the run did not ask for (model.zero3_leaf_modules=[] really means none);
    unchanged below stage 3, for a model without leaf modules, or with the config's own leaf_module block."""
    if dsc.zero_stage(ds) != 3 or dsc.zero3_leaf_block(ds) is not None or dsc.expert_parallel(ds).get("enabled"):
        return ds
    from deepspeed.utils import get_z3_leaf_modules
    flagged = sorted({moe.qualified(type(m)) for m in get_z3_leaf_modules(model)})
    return dsc.with_zero3_leaf_classes(ds, flagged) if flagged or moe.routers(model) else ds


def name_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed from the run seed and a parameter name (Python's hash() is salted per process)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_value(name: str, shape: torch.Size, seed: int, std: float) -> torch.Tensor:
    """Llama's init, per parameter name: norms = 1, biases = 0, everything else N(0, std)."""
    if "norm" in name:
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(name_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=generator)


@torch.no_grad()
def init_weights_by_name(model: torch.nn.Module, seed: int, std: float, rank: int) -> None:
    """Fill every parameter from init_value(); ZeRO-3 partitioned parameters are gathered one at a time
    and rank 0's values are scattered back (GatheredParameters with modifier_rank=0)."""
    for name, param in model.named_parameters():
        if hasattr(param, "ds_id"):  # partitioned by zero.Init
            import deepspeed
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if rank == 0:
                    param.copy_(init_value(name, param.shape, seed, std))
        else:
            param.copy_(init_value(name, param.shape, seed, std))


def enable_gradient_checkpointing(model, ds: dict) -> None:
    """transformers' per-layer checkpointing; with a DeepSpeed `activation_checkpointing` block the
    recompute goes through deepspeed.checkpointing so partition_activations/cpu_checkpointing apply."""
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if dsc.has_activation_checkpointing(ds):
        import deepspeed
        if dsc.cpu_checkpointing(ds) and checkpoints_already_in_host_memory():
            # DeepSpeed 0.19.8's blocking cpu_checkpointing path (a synchronized accelerator has no side stream)
            # copies each input with .to("cpu"), which on the CPU is the tensor itself, then empties that tensor:
            # the recompute reads a 0-d input ("Dimension out of range"). There is nothing to move there anyway.
            ds = dsc.without_cpu_checkpointing(ds)
        deepspeed.checkpointing.configure(None, deepspeed_config=ds)
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=deepspeed.checkpointing.checkpoint)


def checkpoints_already_in_host_memory() -> bool:
    """A synchronized accelerator (DeepSpeed's CPU one) computes in host memory: no checkpoint has anywhere to go."""
    from deepspeed.accelerator import get_accelerator
    return get_accelerator().is_synchronized_device()


def checkpoint_offload_in_use(cfg) -> str:
    """For the start-up log: where the activation checkpoints wait for their backward ('' when on the device)."""
    if not (cfg.model.gradient_checkpointing and dsc.cpu_checkpointing(cfg.deepspeed)):
        return ""
    where = ("(a CPU accelerator: they are there already, and DeepSpeed's copy is skipped)"
             if checkpoints_already_in_host_memory() else "all but the newest, copied on a side stream")
    return f"; activation checkpoints in host memory (DeepSpeed cpu_checkpointing) {where}"


def maybe_apply_liger(model_cfg: ModelConfig, zero_stage: int = 0) -> bool:
    """Liger's fused kernels patch transformers' modules of model.family; CUDA + liger-kernel only. Returns whether
    they were applied (trainer.loss_path then decides the loss path from it).

    Under ZeRO-3 Liger's fused linear cross-entropy is not patched in: it reads `lm_head.weight` by attribute inside
    the model's forward without calling `lm_head`, so ZeRO-3's gather hook would not fire and the kernel would get an
    empty shard (the crash trl fixed for its own Liger losses, PR #5891); whether DeepSpeed 0.19.8's forward gathers
    such a weight anyway is for the GPU check to say. The model computes its loss on full logits then, with Liger's
    cross-entropy set on that model alone (`liger_loss_function`, by `scope_liger_loss`), never through Liger's
    `cross_entropy=True`, which replaces torch.nn.functional.cross_entropy for the whole process (the sequence-parallel
    and tiled losses and evaluation included). The planner counts the full logits there (trainer.loss_path)."""
    if not model_cfg.liger:
        return False
    if not torch.cuda.is_available() or importlib.util.find_spec("liger_kernel") is None:
        log.warning("model.liger is on but Liger needs CUDA and the liger-kernel package; running without it")
        return False
    from liger_kernel.transformers import monkey_patch
    apply = getattr(monkey_patch, f"apply_liger_kernel_to_{model_cfg.family}", None)
    if apply is None:
        log.warning("Liger has no kernels for model family %r; running without it", model_cfg.family)
        return False
    fused = zero_stage != 3
    if not fused:
        log.warning("model.liger under ZeRO-3: Liger's cross-entropy on this model's full logits instead of its fused "
                    "linear cross-entropy, which cannot gather the ZeRO-3 partitioned lm_head weight")
    apply(fused_linear_cross_entropy=fused, cross_entropy=False)
    return True


def scope_liger_loss(model: torch.nn.Module, zero_stage: int) -> None:
    """Under ZeRO-3 with Liger applied: this model's own loss (transformers' loss_function, set on the instance) uses
    Liger's cross-entropy; nothing else in the process changes."""
    if zero_stage == 3 and liger_applied(model):
        from liger_kernel.transformers.functional import liger_cross_entropy
        model.loss_function = liger_loss_function(liger_cross_entropy)


def liger_loss_function(cross_entropy):
    """transformers' causal-LM loss (ForCausalLMLoss: fp32 logits, labels shifted by one, a mean over predicted tokens
    or a sum over num_items_in_batch) computed by `cross_entropy` (Liger's, on a GPU)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    def loss(logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100,
             shift_labels=None, **kwargs):
        if shift_labels is None:
            shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        flat_logits, flat_labels = logits.float().reshape(-1, vocab_size), shift_labels.reshape(-1).to(logits.device)
        if num_items_in_batch is None:
            return cross_entropy(flat_logits, flat_labels, ignore_index=ignore_index, reduction="mean")
        return cross_entropy(flat_logits, flat_labels, ignore_index=ignore_index, reduction="sum") / num_items_in_batch
    loss.__doc__ = ForCausalLMLoss.__doc__
    return loss


def liger_applied(model: torch.nn.Module) -> bool:
    """Whether Liger's kernels replaced some of `model`'s modules (maybe_apply_liger succeeded before it was built)."""
    return any(type(m).__name__.startswith("Liger") for m in model.modules())


def attention_in_use(model: torch.nn.Module) -> str:
    """The attention implementation transformers dispatches `model` (an engine, PEFT wrapper or plain model) to."""
    return getattr(getattr(unwrap(model), "config", None), "_attn_implementation", None) or "eager"


def apply_lora(model, model_cfg: ModelConfig):
    from peft import LoraConfig, get_peft_model
    lora = model_cfg.lora
    problems = moe.lora_target_problems(model, list(lora.target_modules), list(lora.target_parameters),
                                        lora.dropout)
    if problems:
        raise UserError("; ".join(problems))
    peft_config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                             target_modules=list(lora.target_modules),
                             target_parameters=list(lora.target_parameters) or None, task_type="CAUSAL_LM")
    return get_peft_model(model, peft_config)


def load_lora_merged(adapter_dir: str, dtype: torch.dtype, attention: str = "sdpa", trust_remote_code: bool = False):
    """A LoRA adapter directory (PEFT's save_pretrained) merged into its base model: one plain transformers model,
    what inference and serving engines want. The base is the adapter's own base_model_name_or_path (its code runs
    only with `trust_remote_code`, which the caller takes from the user, never from the adapter's files)."""
    import json
    from pathlib import Path

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = json.loads((Path(adapter_dir) / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base:
        raise UserError(f"{adapter_dir}/adapter_config.json names no base_model_name_or_path: cannot merge the adapter")
    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype, attn_implementation=attention,
                                                     **load_kwargs(trust_remote_code, base, "LoRA base model"))
    except (OSError, ValueError) as err:
        code = refused(err, base, "pass --trust-remote-code")
        raise code or UserError(f"LoRA adapter {adapter_dir}: cannot load its base model {base!r} ({err})") from None
    return PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()


def kernels_in_use(model: torch.nn.Module, loss_kernel: str = "") -> str:
    """What the model as built really runs, for the start-up log: the attention implementation transformers
    dispatches to, the Liger modules that replaced transformers' own (none when Liger fell back), and the loss kernel
    of its training forward (trainer.loss_path.loss_kernel)."""
    liger = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Liger")})
    loss = f", loss {loss_kernel}" if loss_kernel else ""
    return f"attention {attention_in_use(model)}, liger {', '.join(liger) if liger else 'off'}{loss}"


def zero3_leaves_in_use(model: torch.nn.Module) -> str:
    """The ZeRO-3 leaf modules the model carries, for the start-up log ('' when none)."""
    from deepspeed.utils import get_z3_leaf_modules
    counts: dict[str, int] = {}
    for module in get_z3_leaf_modules(model):
        counts[type(module).__name__] = counts.get(type(module).__name__, 0) + 1
    return ", ".join(f"{count} x {name}" for name, count in counts.items())


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(total, trainable) parameter counts, correct under ZeRO-3 (ds_numel is the unpartitioned size)."""
    total = trainable = 0
    for param in model.parameters():
        numel = getattr(param, "ds_numel", param.numel())
        total += numel
        trainable += numel if param.requires_grad else 0
    return total, trainable


def returns_as_default(settings: dict, defaults: dict) -> dict:
    """transformers' switches of what a call returns (`output_*`, `return_*`: router logits, hidden states,
    attentions, scores, a dict from generate) that differ from their class's defaults, set back to them."""
    return {key: defaults[key] for key, value in settings.items()
            if key.startswith(("output_", "return_")) and key in defaults and value != defaults[key]}


def unwrap(module: torch.nn.Module):
    """The transformers model inside a DeepSpeed engine and/or a PEFT wrapper."""
    return getattr(module, "module", module)

