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
