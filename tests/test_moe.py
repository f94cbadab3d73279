"""Mixture-of-Experts families (issue 27): tiny Mixtral and Qwen3-MoE through the same model builder as the dense
families (init by name, gradient checkpointing, LoRA inside the experts), their ZeRO-3 leaf modules found from the
model, router health from the routers, and bad input named before any step. Fast: one process, no ranks."""
from __future__ import annotations

import pytest
import torch

from conftest import TINY
from distributed import last_wins
from trainer import moe
from trainer.errors import ConfigError, UserError
from trainer.model import build_model
from trainer.presets import load_preset
from trainer.resolve import resolve
from trainer.train import router
from trainer.train.router import RouterWatch

FAMILIES = ["mixtral", "qwen3_moe"]


def moe_overrides(family: str) -> list[str]:
    return TINY + [f"model.family={family}", "model.num_experts=4", "model.num_experts_per_tok=2",
                   "model.intermediate_size=32"]


def config(*overrides: str):
    return resolve(load_preset("tiny_cpu", last_wins(list(overrides))), 1).config


def built(*overrides: str):
    model, _ = build_model(config(*overrides), 0)
    return model


@pytest.fixture(scope="module", params=FAMILIES)
def pretrained(request, tmp_path_factory):
    """(family, directory) of a tiny MoE model built from scratch by the builder and saved: LoRA's base."""
    path = tmp_path_factory.mktemp(request.param)
    built(*moe_overrides(request.param)).save_pretrained(str(path))
    return request.param, path


def batch(seed: int = 0) -> dict:
    ids = torch.randint(0, 1024, (2, 32), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("family", FAMILIES)
def test_an_moe_family_builds_with_its_experts_and_the_same_weights_for_the_same_seed(family):
    model = built(*moe_overrides(family))
    again = built(*moe_overrides(family))
    assert model.config.model_type == family and model.config.num_experts_per_tok == 2
    experts = {name: p.shape for name, p in model.named_parameters() if p.dim() == 3}
    assert len(experts) == 2 * 2  # gate_up_proj and down_proj in each of the 2 layers
    assert all(shape[0] == 4 for shape in experts.values())  # 4 experts
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    assert torch.isfinite(model(**batch()).loss)


@pytest.mark.slow  # two forward/backward passes per family: 3-4 s of CPU each in the quick tier
@pytest.mark.parametrize("family", FAMILIES)
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(family):
    plain, ckpt = built(*moe_overrides(family)), built(*moe_overrides(family), "model.gradient_checkpointing=true")
    plain.train()
    ckpt.train()
    losses = []
    for model in (plain, ckpt):
        loss = model(**batch()).loss
        loss.backward()
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1])
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7), name


def test_the_router_settings_reach_the_model_and_the_aux_loss_joins_the_training_loss():
    model = built(*moe_overrides("mixtral"), "model.router_aux_loss_coef=0.5", "model.output_router_logits=true")
    assert model.config.output_router_logits and model.router_aux_loss_coef == 0.5
    out = model(**batch())
    without = model(**batch(), output_router_logits=False)
    assert torch.allclose(out.loss, without.loss + 0.5 * out.aux_loss)


@pytest.mark.slow  # 3-9 s in the quick tier's list of tests slower than 2 s (issue 36's 120 s budget)
def test_lora_adapts_the_fused_expert_weights_named_as_parameters(pretrained):
    family, path = pretrained
    model = built(*moe_overrides(family), f"model.name_or_path={path}", "model.lora.enabled=true",
                  "model.lora.dropout=0", "model.lora.target_parameters=[experts.gate_up_proj, experts.down_proj]")
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert any(".mlp.experts." in name and "lora_" in name for name in trainable)
    assert not any(name.endswith(("experts.gate_up_proj", "experts.down_proj")) for name in trainable)  # base frozen
    out = model(**batch())
    out.loss.backward()
    expert_b = [p for name, p in model.named_parameters() if ".mlp.experts" in name and "lora_B" in name]
    assert expert_b and all(p.grad is not None and p.grad.abs().sum() > 0 for p in expert_b)


@pytest.mark.parametrize("targets,says", [
    (["model.lora.target_modules=[q_proj, down_proj]"],
     ["'down_proj' is a fused expert weight here", "'experts.down_proj' in model.lora.target_parameters"]),
    (["model.lora.dropout=0", "model.lora.target_parameters=[experts.gate_proj]"],
     ["model.lora.target_parameters: 'experts.gate_proj' names no parameter", "experts.gate_up_proj"]),
    (["model.lora.target_parameters=[experts.down_proj]"], ["model.lora.dropout=0.05", "set model.lora.dropout=0"]),
])
def test_lora_targets_the_experts_cannot_take_are_named(pretrained, targets, says):
    family, path = pretrained
    with pytest.raises(UserError) as err:
        built(*moe_overrides(family), f"model.name_or_path={path}", "model.lora.enabled=true", *targets)
    assert all(fragment in str(err.value) for fragment in says), str(err.value)


@pytest.mark.parametrize("family,block", [("mixtral", "MixtralSparseMoeBlock"), ("qwen3_moe", "Qwen3MoeSparseMoeBlock")])
def test_the_zero3_leaf_modules_are_the_blocks_that_own_a_router(family, block):
    model = built(*moe_overrides(family))
    found = moe.zero3_leaf_classes(model, None)
    assert [name.rsplit(".", 1)[-1] for name in found] == [block]
    assert moe.zero3_leaf_classes(model, [block]) == found  # a short class name is the same class
    assert moe.zero3_leaf_classes(model, []) == []
    assert moe.mark_zero3_leaves(model, found) == 2  # one block per layer
    from deepspeed.utils import get_z3_leaf_modules
    assert {type(m).__name__ for m in get_z3_leaf_modules(model)} == {block}


def test_a_dense_model_has_no_leaf_modules_and_no_router_watch():
    model = built(*TINY)
    assert moe.zero3_leaf_classes(model, None) == [] and RouterWatch.attach(model) is None


def test_leaf_module_names_that_match_nothing_are_named_before_any_step():
    model = built(*moe_overrides("mixtral"))  # build_model asks the same at stage 3, before the engine exists
    with pytest.raises(UserError) as err:
        moe.zero3_leaf_classes(model, ["MixtralSparseMoeBlok"])
    message = str(err.value)
    assert "model.zero3_leaf_modules: 'MixtralSparseMoeBlok' match no module class" in message
    assert "did you mean 'MixtralSparseMoeBlock'?" in message


@pytest.mark.parametrize("overrides,says", [
    (["model.family=gpt2"], "model.family 'gpt2' is not a family the trainer builds"),
    (["model.num_experts=4"], "model.num_experts: MoE settings, but model.family=llama is a dense family"),
    (["model.family=mixtral"], "model.num_experts is required for the MoE family mixtral"),
    (["model.family=qwen3_moe", "model.num_experts=2", "model.num_experts_per_tok=3"],
     "model.num_experts_per_tok=3 exceeds model.num_experts=2"),
    (["model.zero3_leaf_modules=[X]", "deepspeed.zero_optimization.stage=3",
      "deepspeed.zero_optimization.leaf_module={classes: [X]}"], "keep one"),
])
def test_bad_moe_settings_are_named_when_the_config_is_resolved(overrides, says):
    with pytest.raises(ConfigError) as err:
        config(*TINY, *overrides)
    assert says in str(err.value)


def test_router_health_equals_transformers_load_balancing_loss():
    model = built(*moe_overrides("mixtral"), "model.output_router_logits=true")
    model.train()
    watch = RouterWatch.attach(model)
    out = model(**batch())
    health = watch.window("cpu")
    assert health["router_aux_loss"] == pytest.approx(float(out.aux_loss.detach()), rel=1e-5)
    assert health["expert_share_max_over_mean"] >= 1.0 >= health["expert_share_min_over_mean"] >= 0.0
    assert watch.window("cpu") == {}  # the window starts again empty
    model.eval()
    with torch.no_grad():
        model(**batch())
    assert watch.window("cpu") == {}  # evaluation forwards are not training traffic
    model.train()
    with torch.no_grad(), router.uncounted():  # how a LoRA preference run's reference (adapter off) runs
        model(**batch())
    assert watch.window("cpu") == {}
    with torch.no_grad():  # a training forward without grad (DeepSpeed's checkpointing runs them so) counts
        model(**batch())
    assert watch.window("cpu")["router_aux_loss"] > 0


@pytest.mark.slow  # 3-9 s in the quick tier's list of tests slower than 2 s (issue 36's 120 s budget)
def test_router_health_counts_each_training_forward_once_under_gradient_checkpointing():
    plain, ckpt = built(*moe_overrides("qwen3_moe")), built(*moe_overrides("qwen3_moe"),
                                                             "model.gradient_checkpointing=true")
    healths = []
    for model in (plain, ckpt):
        model.train()
        watch = RouterWatch.attach(model)
        model(**batch()).loss.backward()  # the checkpointed model runs its routers again inside backward
        assert float(watch.counts.sum()) == 2 * 32 * 2 * 2  # tokens x top-k x layers: each assignment once
        healths.append(watch.window("cpu"))
    assert healths[0] == pytest.approx(healths[1])


def test_expert_shares_say_which_expert_is_dead_or_hot():
    watch = RouterWatch([], top_k=1)
    watch.layers = 1
    logits = torch.tensor([[9.0, 0.0, 0.0, 0.0]] * 6 + [[0.0, 9.0, 0.0, 0.0]] * 2)  # 6 tokens to expert 0, 2 to 1
    watch.add(0, logits)
    health = watch.window("cpu")
    assert health["expert_share_max_over_mean"] == pytest.approx(6 / 2)
    assert health["expert_share_min_over_mean"] == 0.0


def test_mfu_counts_the_experts_a_token_passes_through():
    from trainer.model import count_parameters
    from trainer.plan import memory as mem
    model = built(*moe_overrides("mixtral"))
    total, _ = count_parameters(model)
    cfg = config(*moe_overrides("mixtral")).model
    assert total == mem.count_params(cfg)  # the planner counts what the builder builds
    assert moe.active_parameters(model, total) == mem.active_params(cfg) == total - 2 * 2 * 3 * 64 * 32


@pytest.mark.parametrize("family,fields,block", [
    ("qwen2_moe", {"num_experts": 4, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16},
     "Qwen2MoeSparseMoeBlock"),
    ("olmoe", {"num_experts": 4}, "OlmoeSparseMoeBlock"),
    ("granitemoe", {"num_local_experts": 4}, "GraniteMoeMoE"),
])
def test_the_leaf_blocks_and_routers_of_moe_families_without_a_preset_are_found_too(family, fields, block):
    """A pretrained MoE model of a family the trainer has no inline config for (model.name_or_path): its blocks are
    found the same way (DeepSpeed's own default list names Mixtral and the Qwen MoE blocks only)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model(family, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=32, vocab_size=128, num_experts_per_tok=2,
                                  **fields)
    model = AutoModelForCausalLM.from_config(config)
    assert [name.rsplit(".", 1)[-1] for name in moe.zero3_leaf_classes(model, None)] == [block]
    watch = RouterWatch.attach(model)
    model.train()
    model(input_ids=torch.arange(32).reshape(2, 16))
    assert float(watch.counts.sum()) == 2 * 16 * 2 * 2  # tokens x top-k x layers


@pytest.mark.slow  # 3-9 s in the quick tier's list of tests slower than 2 s (issue 36's 120 s budget)
def test_a_lora_adapter_on_the_experts_merges_into_a_plain_model_with_the_same_logits(pretrained, tmp_path):
    """What export_merged does with a LoRA run's adapter: the merged model (no PEFT) gives the adapted logits."""
    from trainer.model import load_lora_merged
    family, path = pretrained
    model = built(*moe_overrides(family), f"model.name_or_path={path}", "model.lora.enabled=true",
                  "model.lora.dropout=0", "model.lora.target_parameters=[experts.gate_up_proj, experts.down_proj]")
    with torch.no_grad():  # an adapter that changes something (lora_B starts at zero)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    model.eval()
    ids = batch()["input_ids"]
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
    model.save_pretrained(str(tmp_path))
    merged = load_lora_merged(str(tmp_path), torch.float32).eval()
    assert not any("lora" in name for name, _ in merged.named_parameters())
    assert torch.allclose(merged(input_ids=ids).logits, adapted, atol=1e-5)
    with model.disable_adapter():
        base = model(input_ids=ids).logits
    assert (adapted - base).abs().max() > 1e-3  # the expert adapters took part in the logits


def test_the_engine_config_names_exactly_the_leaf_modules_the_model_carries():
    """DeepSpeed applies its own default leaf list (Mixtral, Qwen MoE blocks) at engine start unless the config names
    one: the engine config lists what the model carries, so model.zero3_leaf_modules=[] really means none."""
    from trainer.model import zero3_leaf_config
    ds = {"zero_optimization": {"stage": 3}}
    model = built(*moe_overrides("mixtral"))  # stage 2 here: nothing flagged yet
    assert zero3_leaf_config(model, ds)["zero_optimization"]["leaf_module"]["classes"] == []
    moe.mark_zero3_leaves(model, moe.zero3_leaf_classes(model, None))
    assert zero3_leaf_config(model, ds)["zero_optimization"]["leaf_module"]["classes"] == [
        "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock"]
    assert zero3_leaf_config(model, {"zero_optimization": {"stage": 2}}) == {"zero_optimization": {"stage": 2}}
    assert zero3_leaf_config(built(*TINY), ds) == ds  # a dense model: DeepSpeed's config untouched


EP2 = "deepspeed.expert_parallel={enabled: true, autoep_size: 2}"


@pytest.mark.parametrize("overrides,world,says", [
    (["model.num_experts=3", EP2], 2, "autoep_size=2 must divide the 3 experts per layer"),
    ([EP2], 3, "autoep_size=2 must divide the world size 3"),
    (["deepspeed.expert_parallel={autoep_size: 2}"], 2, "without deepspeed.expert_parallel.enabled=true"),
    (["deepspeed.expert_parallel={enabled: true, autoep_size: two}"], 2,
     "deepspeed.expert_parallel.autoep_size: 'two' must be a whole number"),  # ds.check: AutoEP's parser's types
    (["model.name_or_path=org/tiny-mixtral", "model.lora.enabled=true", "model.lora.dropout=0", EP2], 2,
     "AutoEP replaces the expert modules PEFT adapts"),
    (["deepspeed.tensor_parallel={autotp_size: 2}", EP2], 2, "with tensor_parallel.autotp_size"),
    (["deepspeed.expert_parallel={enabled: true, autoep_sise: 2}"], 2,
     "deepspeed.expert_parallel.autoep_sise: not read by DeepSpeed (it would be silently ignored) (did you mean "
     "'autoep_size'?)"),  # learned from DeepSpeed's own parser (trainer/ds/learned.py)
])
def test_expert_parallel_settings_deepspeed_cannot_run_are_named_when_the_config_is_resolved(overrides, world, says):
    with pytest.raises(ConfigError) as err:
        resolve(load_preset("tiny_cpu", last_wins(moe_overrides("mixtral") + overrides)), world)
    assert says in str(err.value), str(err.value)


def test_expert_parallel_on_a_dense_family_is_named():
    with pytest.raises(ConfigError) as err:
        resolve(load_preset("tiny_cpu", last_wins(TINY + [EP2])), 2)
    assert "deepspeed.expert_parallel: the model is 'llama'" in str(err.value)


def test_every_moe_family_has_a_deepspeed_autoep_preset_for_the_installed_transformers():
    """The families the rules accept for expert parallelism are those DeepSpeed's AutoEP presets know, with the
    fused 3D experts and the names transformers 5.x gives them (gate_up_proj, down_proj, gate)."""
    from deepspeed.module_inject.auto_ep_presets.registry import PRESET_MODELS
    for family in moe.MOE_FAMILIES:
        preset = PRESET_MODELS[family]
        assert family in preset.hf_model_types and preset.expert_storage == "fused_3d"
        model = built(*moe_overrides(family))
        block = model.model.layers[0].mlp
        experts = getattr(block, preset.experts_pattern)
        assert isinstance(getattr(block, preset.router_pattern), torch.nn.Module)
        assert getattr(experts, preset.expert_w1).dim() == getattr(experts, preset.expert_w2).dim() == 3
        assert getattr(model.config, preset.num_experts_attr) == 4


def test_autoep_reads_the_installed_transformers_output_capture_registry():
    """DeepSpeed 0.19.8's AutoEP asks the registry `get(key, default)`; transformers 5.24's takes a model only.
    With the trainer's adapter both forms answer, as a dict and as transformers."""
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    moe.enable_autoep_with_installed_transformers()
    moe.enable_autoep_with_installed_transformers()  # idempotent
    model = built(*moe_overrides("mixtral"))
    key = str(type(model).__mro__[0])
    assert _CAN_RECORD_REGISTRY.get("no such class", "default") == "default"
    assert _CAN_RECORD_REGISTRY.get(model) == (dict.get(_CAN_RECORD_REGISTRY, key) or {})
