"""Mixture-of-Experts models (mixtral, qwen3_moe): their inline config fields, their routers, and the MoE blocks
ZeRO-3 must treat as leaf modules.

The routers and blocks are found from the model itself, not from a table of class names: a transformers MoE model
declares the module whose output is its router logits (`_can_record_outputs["router_logits"]`), and the MoE block is
the module that owns each router (it holds the router and the experts). Under ZeRO-3 that block is a leaf module
(DeepSpeed's `set_z3_leaf_modules`): its parameters are gathered whole when it is entered, so ranks that route their
tokens to different experts still issue the same gathers in the same order. In transformers 5.x the experts are fused
3D parameters (`experts.gate_up_proj`, `experts.down_proj`) of one module that every rank enters, so one gather covers
all experts even without the leaf flag (tests/test_moe_zero3.py runs both); with one nn.Module per expert (older
transformers, remote code) a rank that routes no token to an expert skips that expert's hooks, and DeepSpeed's
set_z3_leaf_modules docstring names this as the MoE case leaf modules exist for.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from .config import LLAMA_LIKE, ModelConfig
from .errors import UserError, closest

if TYPE_CHECKING:  # torch is imported by the functions that get a model, so the rules can read this module light
    import torch

MOE_FAMILIES = ("mixtral", "qwen3_moe")
FAMILIES = LLAMA_LIKE + MOE_FAMILIES   # what the trainer builds from an inline architecture (model.family)
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "router_aux_loss_coef", "output_router_logits", "head_dim")


def is_moe(model_cfg: ModelConfig) -> bool:
    return model_cfg.family in MOE_FAMILIES


def family_problems(model_cfg: ModelConfig, pretrained_type: Optional[str] = None) -> list[str]:
    """An inline architecture the trainer cannot build (unknown family, MoE settings on a dense family, an MoE family
    without its experts), one message each naming the key. With model.name_or_path the pretrained config decides the
    architecture; only MoE settings on a dense one (`pretrained_type`: its model_type) are refused: never read."""
    m = model_cfg
    if m.name_or_path:
        dense = (pretrained_type or m.family) in LLAMA_LIKE
        which = f"the pretrained model's model_type {pretrained_type or m.family}"
        return _moe_keys_on_dense(m, which) if dense else []
    if m.family not in FAMILIES:
        return [f"model.family {m.family!r} is not a family the trainer builds from an inline architecture"
                f"{closest(m.family, FAMILIES)}; supported: {', '.join(FAMILIES)} (or give model.name_or_path)"]
    if not is_moe(m):
        return _moe_keys_on_dense(m, f"model.family={m.family}")
    if m.num_experts is None:
        return [f"model.num_experts is required for the MoE family {m.family} (experts per layer, e.g. 8)"]
    top_k = m.num_experts_per_tok or 2
    if top_k > m.num_experts:
        return [f"model.num_experts_per_tok={top_k} exceeds model.num_experts={m.num_experts}: a token cannot be "
                f"routed to more experts than there are"]
    return []


def _moe_keys_on_dense(m: ModelConfig, which: str) -> list[str]:
    set_here = [f"model.{name}" for name in MOE_FIELDS if getattr(m, name) is not None]
    return [f"{', '.join(set_here)}: MoE settings, but {which} is a dense family; remove them or use an MoE family "
            f"({', '.join(MOE_FAMILIES)})"] if set_here else []


def router_settings(model_cfg: ModelConfig) -> dict[str, Any]:
    """router_aux_loss_coef / output_router_logits the preset sets (transformers' config names), for the inline
    config and for from_pretrained (which passes them to the loaded config); unset keeps the model's own."""
    return {name: getattr(model_cfg, name) for name in ("router_aux_loss_coef", "output_router_logits")
            if getattr(model_cfg, name) is not None}


def moe_config_fields(model_cfg: ModelConfig) -> dict[str, Any]:
    """The transformers config fields of an inline MoE architecture. `num_experts` is the attribute-mapped name both
    MixtralConfig and Qwen3MoeConfig accept; `intermediate_size` is each expert's width (Mixtral's own meaning, and
    Qwen3-MoE's moe_intermediate_size: its dense intermediate_size only serves mlp_only_layers, none here)."""
    if not is_moe(model_cfg):
        return {}
    m = model_cfg
    fields = {"num_experts": m.num_experts, "num_experts_per_tok": m.num_experts_per_tok or 2,
              "head_dim": m.head_dim or m.hidden_size // m.num_heads, **router_settings(m)}
    if m.family == "qwen3_moe":
        fields["moe_intermediate_size"] = m.intermediate_size
    return fields


# --- expert parallelism (DeepSpeed AutoEP) ---------------------------------------------------------------------

def expert_parallel_problems(ds_block: dict, world: int, model_type: str, num_experts: Optional[int],
                             lora: bool, autotp: int, sequence_parallel: int) -> list[str]:
    """What DeepSpeed's AutoEP (the `expert_parallel` section) cannot do with this run, before any rank starts:
    DeepSpeed checks the experts only after it has built the model on every rank (validate_autoep_post_detection),
    and ignores an autoep_size without `enabled`."""
    if not ds_block:
        return []
    key, size = "deepspeed.expert_parallel", ds_block.get("autoep_size", 1)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        return [f"{key}.autoep_size: {size!r} must be a whole number of ranks (1 = every rank holds every expert)"]
    if not ds_block.get("enabled"):  # a bool: ds.check refused any other value (DeepSpeed reads it by truth)
        return [f"{key}.autoep_size={size} without {key}.enabled=true: DeepSpeed ignores the section; set "
                f"enabled: true, or remove the section"] if size > 1 else []
    problems = []
    if model_type not in MOE_FAMILIES:
        problems.append(f"{key}: the model is {model_type!r}; expert parallelism is wired for the MoE families "
                        f"{', '.join(MOE_FAMILIES)} (DeepSpeed AutoEP presets of transformers' fused experts); "
                        f"remove the section for a dense model")
    if world % size:
        problems.append(f"{key}.autoep_size={size} must divide the world size {world}: each group of {size} ranks "
                        f"shares one copy of the experts; use one of "
                        f"{[d for d in range(1, world + 1) if world % d == 0]}")
    if num_experts and num_experts % size:
        problems.append(f"{key}.autoep_size={size} must divide the {num_experts} experts per layer (every rank "
                        f"holds the same number); use one of "
                        f"{[d for d in range(1, num_experts + 1) if num_experts % d == 0 and world % d == 0]}")
    if lora:
        problems.append(f"{key} with model.lora.enabled: AutoEP replaces the expert modules PEFT adapts (its "
                        f"experts are DeepSpeed's own grouped weights); train LoRA without expert parallelism, or "
                        f"full fine-tune with it")
    if autotp > 1 or sequence_parallel > 1:
        problems.append(f"{key} with {'tensor_parallel.autotp_size' if autotp > 1 else 'sequence_parallel_size'}: "
                        f"expert parallelism is wired here on data-parallel ranks only (checkpoints and export "
                        f"are not verified with AutoEP folding); keep one of them")
    return problems


def enable_autoep_with_installed_transformers() -> None:
    """DeepSpeed 0.19.8's AutoEP (module_inject/auto_ep_presets/base.py:326) reads transformers' output-capture
    registry as a dict, `registry.get(key, default)`; transformers 5.24's _CanRecordRegistry.get(model) takes a
    model and no default, so deepspeed.initialize stops with "TypeError: _CanRecordRegistry.get() takes 2
    positional arguments but 3 were given". The registry is keyed by the class name string, which is what AutoEP
    passes: a string key is looked up as the dict it is, a model as transformers does. Idempotent."""
    from transformers.utils import output_capturing
    registry = getattr(output_capturing, "_CanRecordRegistry", None)
    if registry is None or getattr(registry.get, "_autoep_compatible", False):
        return
    by_model = registry.get

    def get(self, key, *default):
        return dict.get(self, key, *default) if isinstance(key, str) else by_model(self, key)

    get._autoep_compatible = True
    registry.get = get


# --- routers and MoE blocks, found in the built model ---------------------------------------------------------

def _router_recorder(model: torch.nn.Module):
    """transformers' OutputRecorder for router logits of the model (None: not a transformers MoE model). The
    instance's own comes first: DeepSpeed AutoEP retargets it to its router's gate (`router.gate`, raw logits)."""
    for module in model.modules():  # the causal LM may sit inside a PEFT wrapper
        recorders = getattr(module, "_can_record_outputs", None) or {}
        if "router_logits" in recorders:
            return recorders["router_logits"]
    return None


def routers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, int]]:
    """(name, router module, index of the logits in its output) for every router of the model."""
    recorder = _router_recorder(model)
    if recorder is None or getattr(recorder, "target_class", None) is None:
        return []
    index, layer_name = recorder.index or 0, getattr(recorder, "layer_name", None)
    return [(name, module, index) for name, module in model.named_modules()
            if isinstance(module, recorder.target_class) and (not layer_name or name.endswith(layer_name))]


def experts_per_token(model: torch.nn.Module) -> int:
    """The model config's top-k (num_experts_per_tok), through any wrapper; 1 when it has none."""
    for module in model.modules():
        top_k = getattr(getattr(module, "config", None), "num_experts_per_tok", None)
        if top_k:
            return int(top_k)
    return 1


def active_parameters(model: torch.nn.Module, total: int) -> int:
    """Of `total`, the parameters one token passes through: each fused expert weight (a 3D parameter whose first
    dimension is the experts) counts top-k of its experts. Correct under ZeRO-3 (ds_shape is the full shape)."""
    if not routers(model):
        return total
    top_k, idle = experts_per_token(model), 0
    for name, param in model.named_parameters():
        shape = tuple(getattr(param, "ds_shape", param.shape))
        if len(shape) == 3 and ".experts." in f".{name}.":
            numel = shape[0] * shape[1] * shape[2]
            idle += numel - numel * min(top_k, shape[0]) // shape[0]
    return total - idle


def moe_block_classes(model: torch.nn.Module) -> list[type]:
    """The classes of the modules that own a router: the sparse MoE blocks (MixtralSparseMoeBlock, ...)."""
    router_names = {name for name, _, _ in routers(model)}
    classes: dict[type, None] = {}
    for name, module in model.named_modules():
        if any(child and f"{name}.{child}" in router_names for child, _ in module.named_children()):
            classes[type(module)] = None
    return list(classes)


def qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def zero3_leaf_classes(model: torch.nn.Module, asked: Optional[list[str]]) -> list[str]:
    """The fully qualified class names to make ZeRO-3 leaf modules: `asked` (model.zero3_leaf_modules: class names or
    module.QualNames, each must match a module of the model) or, when None, the model's MoE blocks."""
    if asked is None:
        return [qualified(cls) for cls in moe_block_classes(model)]
    present = {}
    for module in model.modules():
        present.setdefault(type(module).__name__, qualified(type(module)))
        present.setdefault(qualified(type(module)), qualified(type(module)))
    missing = [name for name in asked if name not in present]
    if missing:
        blocks = [cls.__name__ for cls in moe_block_classes(model)]
        hint = f"; this model's MoE blocks are {', '.join(blocks)}" if blocks else ""
        raise UserError(f"model.zero3_leaf_modules: {', '.join(map(repr, missing))} match no module class of the model"
                        f"{closest(missing[0], [n for n in present if '.' not in n])}{hint}; give class names of "
                        f"modules in the model, or remove the key to use the MoE blocks found automatically")
    return list(dict.fromkeys(present[name] for name in asked))


def mark_zero3_leaves(model: torch.nn.Module, classes: list[str]) -> int:
    """Flag every module of `classes` as a ZeRO-3 leaf (DeepSpeed's set_z3_leaf_modules); returns how many."""
    if not classes:
        return 0
    from deepspeed.utils import set_z3_leaf_modules
    return len(set_z3_leaf_modules(model, classes))


# --- LoRA targets -----------------------------------------------------------------------------------------------

def lora_target_problems(model: torch.nn.Module, target_modules: list[str], target_parameters: list[str],
                         dropout: float = 0.0) -> list[str]:
    """LoRA targets that name nothing PEFT can adapt in this model, with what it has: nn.Linear modules for
    target_modules, parameters (e.g. the fused 3D expert weights of transformers 5.x MoE) for target_parameters."""
    from torch import nn
    modules = [name for name, _ in model.named_modules() if name]
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
    params = {name for name, _ in model.named_parameters()}
    expert_params = sorted({".".join(name.split(".")[-2:]) for name, p in model.named_parameters() if p.dim() == 3})
    problems = []
    for name in target_modules:  # PEFT matches a module whose name is the target or ends with "." + target
        if name == "all-linear" or any(m == name or m.endswith("." + name) for m in modules):
            continue
        fused = [p for p in expert_params if p.split(".")[-1] == name]
        hint = (f" ({name!r} is a fused expert weight here, a 3D parameter and no nn.Linear: list {fused[0]!r} in "
                f"model.lora.target_parameters instead)") if fused else ""
        problems.append(f"model.lora.target_modules: {name!r} names no module of this model{hint}; its linear "
                        f"layers are {', '.join(linear)}")
    if target_parameters and dropout:  # PEFT's ParamWrapper (LoRA on a parameter) refuses dropout at build
        problems.append(f"model.lora.dropout={dropout}: PEFT adapts model.lora.target_parameters without dropout; "
                        f"set model.lora.dropout=0")
    for name in target_parameters:
        if not any(p == name or p.endswith("." + name) for p in params):
            problems.append(f"model.lora.target_parameters: {name!r} names no parameter of this model"
                            f"{closest(name, expert_params)}; "
                            + (f"its expert weights are {', '.join(expert_params)}" if expert_params
                               else "it has no fused expert weights"))
    return problems
