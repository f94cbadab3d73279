"""The MoE presets rehearsed on 2 CPU ranks in one launch, as a new user would first try them:
`deepspeed --num_gpus 2 train.py --preset mixtral_8x7b_8xa100 --rehearse` (ZeRO-3 + AutoEP, its 8 experts split
over the 2 ranks present, CPU optimizer) saves at step 3, resumes to step 6 and exports a model plain transformers
loads; the same rehearsal without expert parallelism trains the same losses and exports the same logits. The
Qwen3-30B-A3B LoRA preset (ZeRO-3, LoRA on attention and on the fused experts) saves, resumes and exports too."""
from __future__ import annotations

import math

import pytest
import torch

from distributed import losses, read_metrics, run_many

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def rehearsals(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_presets")

    def rehearsal(preset, directory, *extra):
        return {"name": directory, "preset": preset, "rehearse": True,
                "overrides": [f"train.output_dir={root / directory}", *extra]}

    output, _ = run_many([
        rehearsal("mixtral_8x7b_8xa100", "mixtral", "train.stop_after=3"),
        rehearsal("mixtral_8x7b_8xa100", "mixtral", "train.resume=auto"),
        rehearsal("mixtral_8x7b_8xa100", "mixtral_no_ep", "deepspeed.expert_parallel=null"),
        rehearsal("qwen3_30b_a3b_8xh100", "qwen3", "train.stop_after=3"),
        rehearsal("qwen3_30b_a3b_8xh100", "qwen3", "train.resume=auto"),
    ], root)
    return root, output


def test_the_mixtral_rehearsal_saves_resumes_and_trains_as_without_expert_parallelism(rehearsals):
    root, output = rehearsals
    assert "expert_parallel.autoep_size 8 -> 2 (ranks present)" in output
    assert "resume: continuing from" in output and "step_00000003" in output
    assert [row["step"] for row in read_metrics(root / "mixtral")[0]] == list(range(1, 7))
    assert losses(root / "mixtral") == pytest.approx(losses(root / "mixtral_no_ep"), rel=1e-5)


def test_the_mixtral_rehearsal_export_loads_in_transformers_with_the_logits_of_the_run_without_ep(rehearsals):
    from transformers import AutoModelForCausalLM
    root, _ = rehearsals
    model, info = AutoModelForCausalLM.from_pretrained(str(root / "mixtral" / "hf"), output_loading_info=True)
    assert type(model).__name__ == "MixtralForCausalLM" and model.config.num_local_experts == 8
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    reference = AutoModelForCausalLM.from_pretrained(str(root / "mixtral_no_ep" / "hf"))
    tokens = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(tokens).logits, reference.eval()(tokens).logits,
                                   rtol=1e-4, atol=1e-4)


def test_the_qwen3_lora_rehearsal_saves_resumes_and_exports_its_adapter(rehearsals):
    root, _ = rehearsals
    rows = read_metrics(root / "qwen3")[0]
    assert [row["step"] for row in rows] == list(range(1, 7)) and all(math.isfinite(r["loss"]) for r in rows)
    assert (root / "qwen3" / "hf" / "adapter_config.json").is_file()


PROMPTS = ["Once upon a time", "The little cat", "What is"]  # three lengths: a left-padded batch


def plain_completions(model, tokenizer, prompts: list[str], max_new: int) -> list[str]:
    """Greedy completions by plain transformers, cut at the export's own end tokens (generation_config.json)
    and the tokenizer's EOS."""
    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        out = model.eval().generate(**batch, max_new_tokens=max_new, do_sample=False)
    stops = model.generation_config.eos_token_id  # a LoRA base saved for a rehearsal may name none: EOS then
    stops = {*(stops if isinstance(stops, list) else [stops]), tokenizer.eos_token_id} - {None}
    texts = []
    for row in out[:, batch["input_ids"].shape[1]:].tolist():
        ends = [row.index(s) for s in stops if s in row]
        texts.append(tokenizer.decode(row[:min(ends)] if ends else row, skip_special_tokens=True))
    return texts


def trainer_completions(model_dir, max_new: int) -> list[str]:
    import json

    from distributed import run_cli
    args = [a for p in PROMPTS for a in ("--prompt", p)]
    proc = run_cli("generate", "--model", str(model_dir), *args, "--greedy", "--max-new-tokens", str(max_new),
                   "--format", "jsonl")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line)["completion"] for line in proc.stdout.splitlines()]


def test_generate_with_three_prompts_on_the_mixtral_export_equals_plain_transformers(rehearsals):
    """Training keeps output_router_logits on (the aux loss); the export must not, or batched generate fails in
    transformers' load_balancing_loss_func."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    root, _ = rehearsals
    export = root / "mixtral" / "hf"
    model = AutoModelForCausalLM.from_pretrained(str(export))
    assert model.config.output_router_logits is False
    assert trainer_completions(export, 8) == plain_completions(model, AutoTokenizer.from_pretrained(str(export)),
                                                               PROMPTS, 8)


def test_generate_with_three_prompts_on_the_qwen3_lora_export_equals_plain_transformers(rehearsals):
    from transformers import AutoTokenizer

    from trainer.model import load_lora_merged
    root, _ = rehearsals
    export = root / "qwen3" / "hf"
    merged = load_lora_merged(str(export), torch.float32)
    assert not [k for k, v in merged.config.to_dict().items() if k.startswith("output_") and v is True]
    assert trainer_completions(export, 8) == plain_completions(merged, AutoTokenizer.from_pretrained(str(export)),
                                                               PROMPTS, 8)
