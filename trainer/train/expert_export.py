"""The HF state dict of a model whose MoE blocks DeepSpeed's AutoEP replaced (deepspeed.expert_parallel).

AutoEP swaps every MoE block for its AutoEPMoELayer: the router becomes `router.gate`, and each rank keeps only its
experts, as grouped weights w1 (gate), w3 (up), w2 (down) of shape [local experts, ...] (deepspeed/moe/ep_repack.py:
repack_expert_weights). DeepSpeed 0.19.8 ships no way back to the transformers layout, and refuses its own ZeRO-3
consolidation with AutoEP ("_zero3_consolidated_16bit_state_dict is not supported for AutoEP with ZeRO Stage 3",
runtime/engine.py: _raise_if_autoep_zero3_consolidated_export). So an export gathers each module's parameters with
ZeRO's GatheredParameters (each over its own partition group: the experts' is the expert-data-parallel group), joins
the experts of the EP group in rank order (rank r holds experts [r*E/ep, (r+1)*E/ep)), and writes the transformers
names: gate_up_proj = [w1; w3] along the expert's output dimension, down_proj = w2, gate = router.gate.
"""
from __future__ import annotations

from typing import Optional

import torch

EXPERT_NAMES = {"w1", "w2", "w3"}
ROUTER = "router.gate.weight"


def autoep_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """{module name: AutoEPMoELayer} of the model (empty when AutoEP replaced nothing)."""
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
    return {name: module for name, module in model.named_modules() if isinstance(module, AutoEPMoELayer)}


def hf_state_dict(model: torch.nn.Module, stage3: bool) -> Optional[dict]:
    """Every tensor complete on CPU under transformers' names, on rank 0 (None elsewhere). Collective."""
    import torch.distributed as dist
    layers = autoep_layers(model)
    _check_known_parameters(layers)
    gathered = {} if dist.get_rank() == 0 else None
    for module_name, module in model.named_modules():
        params = list(module.named_parameters(recurse=False))
        if params:
            _gather_module(module_name, module, params, layers, stage3, gathered)
    if gathered is None:
        return None
    every_name = {name for name, _ in model.named_parameters(remove_duplicate=False)}  # AutoEP aliases router as gate
    buffers = {k: v.detach().cpu() for k, v in model.state_dict().items() if k not in every_name}
    return _transformers_names({**buffers, **gathered}, layers)


def _gather_module(module_name, module, params, layers, stage3, out: Optional[dict]) -> None:
    import deepspeed
    import torch.distributed as dist
    owner = module_name.rsplit(".experts", 1)[0] if module_name.endswith(".experts") else None
    layer = layers.get(owner) if owner is not None else None
    with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=stage3):
        for name, param in params:
            tensor = param.detach()
            if layer is not None and name in EXPERT_NAMES and layer.ep_size > 1:
                from deepspeed.utils import groups
                group = groups._get_expert_parallel_group(layer.ep_group_name)
                pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
                dist.all_gather(pieces, tensor.contiguous(), group=group)
                tensor = torch.cat(pieces, dim=0)
            if out is not None:
                out[f"{module_name}.{name}" if module_name else name] = tensor.cpu().clone()


def _check_known_parameters(layers: dict) -> None:
    """An AutoEP layer with parameters this mapping does not know (a router bias, shared experts of another family)
    would be exported wrong; say so instead."""
    for prefix, layer in layers.items():
        unknown = [name for name, _ in layer.named_parameters()
                   if name != ROUTER and name.removeprefix("experts.") not in EXPERT_NAMES]
        if unknown:
            raise NotImplementedError(f"HF export of AutoEP layer {prefix}: parameters {unknown} have no "
                                      f"transformers name in this trainer's mapping (router.gate.weight, experts."
                                      f"w1/w2/w3); export a run of this model without deepspeed.expert_parallel")


def _transformers_names(state: dict, layers: dict) -> dict:
    for prefix in layers:
        state[f"{prefix}.gate.weight"] = state.pop(f"{prefix}.{ROUTER}")
        w1, w2, w3 = (state.pop(f"{prefix}.experts.{name}") for name in ("w1", "w2", "w3"))
        state[f"{prefix}.experts.gate_up_proj"] = torch.cat([w1, w3], dim=1)  # gate rows first, as HF chunks them
        state[f"{prefix}.experts.down_proj"] = w2
    return state


def transformers_model(model: torch.nn.Module, state_dict: dict) -> torch.nn.Module:
    """A plain transformers model of `model`'s config holding `state_dict` (its tensors assigned, not copied): what
    an export saves, since the trained module's AutoEP layers have no transformers layout of their own."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(model.config)
    plain.load_state_dict(state_dict, strict=True, assign=True)
    if getattr(model, "generation_config", None) is not None:
        plain.generation_config = model.generation_config
    return plain
