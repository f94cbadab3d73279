"""Expert parallelism through DeepSpeed's AutoEP (deepspeed.expert_parallel) on 2 real CPU ranks, one launch: a tiny
Mixtral under ZeRO-3 trained with its 4 experts split over the 2 ranks (autoep_size=2) follows AutoEP with every
expert on every rank (autoep_size=1) and the run without AutoEP step for step; stopped and resumed it continues exactly; its HF export (the experts gathered from
both ranks into transformers' fused layout) loads in plain transformers with the logits of the run without EP; and
resuming it without expert parallelism is a named error before any step."""
from __future__ import annotations

import pytest
import torch

from conftest import TINY
from distributed import losses, read_metrics, run_many

pytestmark = pytest.mark.multirank

STEPS = 10
MIXTRAL = TINY + [
    "model.family=mixtral", "model.num_experts=4", "model.num_experts_per_tok=2", "model.intermediate_size=64",
    "deepspeed.zero_optimization.stage=3", f"train.max_steps={STEPS}", "train.grad_accum=1", "train.lr=3e-3",
    "train.eval_every=0", "train.save_every=5", "logging.progress_bar=false", "train.dist_timeout_s=120",
]
EP = ["deepspeed.expert_parallel={enabled: true, autoep_size: 2}"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_ep")
    dirs = {name: root / name for name in ("plain", "ep1", "ep", "halves")}

    def run(name, directory, extra, expect_error=False):
        return {"name": name, "preset": "tiny_cpu", "expect_error": expect_error,
                "overrides": MIXTRAL + [f"train.output_dir={directory}", *extra]}

    output, report = run_many([
        run("plain", dirs["plain"], ["train.export_hf=true"]),
        run("ep1", dirs["ep1"], ["deepspeed.expert_parallel={enabled: true, autoep_size: 1}"]),
        run("ep", dirs["ep"], EP + ["train.export_hf=true"]),
        run("halves", dirs["halves"], EP + ["train.stop_after=5"]),
        run("halves", dirs["halves"], EP + ["train.resume=auto"]),
        run("without_ep", dirs["ep"], ["train.resume=auto", "train.max_steps=12"], expect_error=True),
    ], root)
    return dirs, output, {entry["name"]: entry["error"] for entry in report}


def test_experts_split_over_two_ranks_train_as_the_run_without_expert_parallelism(runs):
    dirs, output, _ = runs
    assert "expert parallelism (DeepSpeed AutoEP): experts split over groups of 2 ranks" in output
    plain, ep1, ep = losses(dirs["plain"]), losses(dirs["ep1"]), losses(dirs["ep"])
    assert len(plain) == len(ep) == STEPS and plain[-1] < plain[0]
    assert ep == pytest.approx(ep1, rel=1e-5) and ep1 == pytest.approx(plain, rel=1e-5)  # AutoEP 2 = AutoEP 1 = none
    for field in ("router_aux_loss", "expert_share_max_over_mean"):  # router health read from AutoEP's router
        by_step = [[row[field] for row in read_metrics(dirs[name])[0]] for name in ("plain", "ep")]
        assert by_step[1] == pytest.approx(by_step[0], rel=1e-4), field


def test_an_expert_parallel_run_resumes_exactly(runs):
    dirs, _, _ = runs
    assert [row["step"] for row in read_metrics(dirs["halves"])[0]] == list(range(1, STEPS + 1))
    assert losses(dirs["halves"]) == pytest.approx(losses(dirs["ep"]), abs=1e-6)


def test_the_expert_parallel_export_is_a_plain_transformers_model_with_every_expert(runs):
    from transformers import AutoModelForCausalLM
    dirs, _, _ = runs
    ep, info = AutoModelForCausalLM.from_pretrained(str(dirs["ep"] / "hf"), output_loading_info=True)
    assert type(ep).__name__ == "MixtralForCausalLM"
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    plain = AutoModelForCausalLM.from_pretrained(str(dirs["plain"] / "hf"))
    tokens = torch.randint(0, 1024, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # a wrong expert order or gate/up split would move the logits by far more
        torch.testing.assert_close(ep.eval()(tokens).logits, plain.eval()(tokens).logits, rtol=1e-4, atol=1e-4)


def test_resuming_an_expert_parallel_checkpoint_without_it_is_a_named_error(runs):
    _, _, errors = runs
    message = errors["without_ep"]
    assert message and "expert-parallel 2" in message and "deepspeed.expert_parallel.autoep_size=2" in message


def test_generate_and_evaluate_of_an_expert_parallel_checkpoint_point_to_its_export(runs):
    from trainer.errors import UserError
    from trainer.infer.source import load_model, resolve_source
    dirs, _, _ = runs
    with pytest.raises(UserError, match="expert-parallel run.*use the run's HF export"):
        load_model(resolve_source(str(dirs["ep"] / "checkpoints" / "step_00000010")), torch.float32)
    exported = load_model(resolve_source(str(dirs["ep"] / "hf")), torch.float32)  # what generate/evaluate read
    assert type(exported).__name__ == "MixtralForCausalLM"
