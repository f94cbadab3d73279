"""DeepSpeed's kernel injection (init_inference's replace_with_kernel_inject): which models it can serve, read from
the installed DeepSpeed, and the transformers 5.x layer contract for the layers it injects.

DeepSpeed 0.19.8 replaces a decoder layer only when its class is exactly one of its policies' `_orig_layer_class`
(module_inject/replace_policy.py replace_policies; replace_module.py builds that map by instantiating each policy
with no module, as `injection_problems` does here). For the families the trainer ships, that is transformers'
LlamaDecoderLayer only: Mistral, Qwen2, Mixtral and Qwen3-MoE have no policy, and injection would silently leave
them as they are. The HF Llama container (containers/llama.py) never sets the kernel's `num_kv`, so the fused qkv is
sized 3 x hidden and a grouped-query model fails at load in strided_copy ("Merging tensors is not allowed here!");
only a container whose create_module sets num_kv (containers/llama2.py, Meta's own code) serves GQA. A scaled RoPE
(Llama-3.1's rope_type llama3) is refused by the container's own check (_get_rope_theta), run here on a meta-device
layer. All of this is checked from the config alone, before any weight is read.

The injected layer (DeepSpeedTransformerInference) returns a tuple: (output, attention mask) with its default
return_tuple, (output, presents) whenever a cache is asked for; transformers 5.24's decoder loop takes a layer's
return value as the next hidden states. `hold_layer_contract` wraps each injected layer so it returns the tensor.
"""
from __future__ import annotations

import inspect
import sys

import torch

ALTERNATIVE = ("use --tp N (DeepSpeed AutoTP, which shards any of the shipped families over N GPUs) or leave "
               "--kernel-inject out")


def injection_problems(hf_config) -> list[str]:
    """Why DeepSpeed's kernel injection cannot serve a model of this config ([] when it can)."""
    import deepspeed
    try:
        model = one_layer_on_meta(hf_config)
    except Exception as err:  # noqa: BLE001 - a config transformers cannot build says so itself
        return [f"transformers cannot build a {hf_config.model_type!r} model from its config to check ({err})"]
    policies = injection_policies()
    matched = [(module, policies[type(module)]) for module in model.modules() if type(module) in policies]
    if not matched:
        names = ", ".join(sorted({type(layer).__name__ for layer in stacked_layers(model)})) or "no layer list"
        return [f"DeepSpeed {deepspeed.__version__} has no kernel-injection policy for model_type "
                f"{hf_config.model_type!r} ({names}; its policies cover {policy_layer_names(policies)}): injection "
                f"would leave the model as it is"]
    layer, policy = matched[0]
    container = container_class(policy, layer, hf_config)
    problems = []
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if kv_heads != heads and not serves_grouped_query_attention(container):
        problems.append(f"the model has {heads} attention heads and {kv_heads} key/value heads (grouped-query "
                        f"attention), and DeepSpeed's {container.__name__} sizes the fused qkv for {heads} of each "
                        f"(it never sets the kernel's num_kv): loading fails in strided_copy")
    problems += rope_problems(container, layer)
    return problems


def one_layer_on_meta(hf_config) -> torch.nn.Module:
    """A one-layer model of this config, built on the meta device (no memory, no weights)."""
    import copy

    from transformers import AutoModelForCausalLM
    config = copy.deepcopy(hf_config)
    config.num_hidden_layers = 1
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def stacked_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks of the model's layer lists (its decoder layers)."""
    return [layer for m in model.modules() if isinstance(m, torch.nn.ModuleList) for layer in m]


def injection_policies() -> dict:
    """{layer class: DeepSpeed policy class}, built as DeepSpeed's replace_module builds it."""
    from deepspeed.module_inject.replace_policy import replace_policies
    policies = {}
    for policy in replace_policies:
        policy(None)  # a throw-away instance fills _orig_layer_class (DeepSpeed does the same)
        classes = policy._orig_layer_class
        for layer_class in classes if isinstance(classes, list) else [classes]:
            if layer_class is not None:
                policies[layer_class] = policy
    return policies


def policy_layer_names(policies: dict) -> str:
    return ", ".join(sorted(cls.__name__ for cls in policies))


def container_class(policy, layer: torch.nn.Module, hf_config) -> type:
    """The container DeepSpeed would build for `layer` (module_inject/utils.py policy_to_ds_container)."""
    from deepspeed.inference.config import DeepSpeedInferenceConfig
    from deepspeed.module_inject.utils import policy_to_ds_container
    container = policy_to_ds_container(policy=policy(layer), config=DeepSpeedInferenceConfig(),
                                       model_config=hf_config, layer_id=0, child=layer)
    return type(container)


def serves_grouped_query_attention(container: type) -> bool:
    """DeepSpeed sizes the fused qkv for fewer key/value heads only when the container's create_module sets the
    kernel config's num_kv (ops/transformer/inference/config.py: num_kv=-1 means as many as the heads)."""
    return "num_kv" in inspect.getsource(container.create_module)


def rope_problems(container: type, layer: torch.nn.Module) -> list[str]:
    """The container's own rotary check (containers/llama.py _get_rope_theta refuses a scaled RoPE), run now."""
    check = getattr(sys.modules[container.__module__], "_get_rope_theta", None)
    attention = getattr(layer, "self_attn", None)
    if check is None or attention is None:
        return []
    try:
        check(attention)
    except ValueError as err:
        return [str(err).split(". Run this model")[0]]
    return []


class TensorOutput(torch.nn.Module):
    """An injected layer that returns its hidden states only, as transformers 5.x's decoder loop expects."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, hidden_states, *args, **kwargs):
        out = self.layer(hidden_states, *args, **kwargs)
        return out[0] if isinstance(out, tuple) else out


def hold_layer_contract(model: torch.nn.Module, injected: type | None = None) -> int:
    """Wrap every injected layer (DeepSpeed's DeepSpeedTransformerInference, or `injected`) in `model`'s layer
    lists in TensorOutput; returns how many were wrapped."""
    if injected is None:
        from deepspeed.model_implementations.transformers.ds_transformer import DeepSpeedTransformerInference
        injected = DeepSpeedTransformerInference
    wrapped = 0
    for layers in [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]:
        for index, layer in enumerate(layers):
            if isinstance(layer, injected):
                layers[index] = TensorOutput(layer)
                wrapped += 1
    return wrapped
