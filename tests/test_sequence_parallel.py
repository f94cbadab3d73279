"""Ulysses sequence parallelism (deepspeed.sequence_parallel_size) on 2 real CPU ranks: a run at SP=2 trains the
same global batch as one rank does, step by step (per-step loss within 1e-5 relative over 10 steps, and the same
eval_loss), for pretraining windows and for masked SFT (packed, and padded: shards predict unequal token counts,
some none), under ZeRO-2 and ZeRO-3, with tiled MLPs and tiled logits+loss (DeepSpeed's TiledMLP and
TiledFusedLogitsLoss) and with the activation checkpoints in host memory (cpu_checkpointing); an SP run resumes
exactly; its checkpoint on another layout is a named error.
Launches: the one-rank references (one tiled-logits run among them), every SP run in one 2-rank job, the tiled runs."""
from __future__ import annotations

import pytest
import torch

from conftest import STAGES, TINY
from distributed import eval_losses, losses, read_metrics, run_many
from trainer.errors import UserError
from trainer.train.elastic import ElasticResumeError, Layout, needs_universal
from trainer.train.sequence_parallel import check_right_padded, full_rows

STEPS = 10
SAVE_AT = 5
COMMON = TINY + [f"train.max_steps={STEPS}", "train.eval_every=5", "train.save_every=0"]
SFT = ["data.task=sft", "data.source=data/tiny/sft.jsonl"]
# Ulysses drops the attention mask, so under SP with sdpa packed documents attend across one another (the trainer
# warns; only flash-attn with micro-batch 1 keeps them apart there): the one-rank reference attends across them too
SHARED_DOCUMENTS = ["data.cross_document_attention=true"]
RUNS = {
    "pretrain_z2": STAGES["z2"],
    "pretrain_z3": STAGES["z3"],
    "sft_packed_z2": STAGES["z2"] + SFT + SHARED_DOCUMENTS,
    "sft_padded_z3": STAGES["z3"] + SFT + ["data.packing=false"],
}


@pytest.fixture(scope="module")
def sp_runs(tmp_path_factory):
    """(root, {name: (one-rank run dir, SP=2 run dir)}): the same micro-batch (2) and accumulation (2) on one rank
    and on one SP group of 2 ranks, so both consume the same 4 samples per step in the same order. The SP launch
    also trains root/straight and root/halves (stopped at SAVE_AT, resumed) for the resume tests."""
    root = tmp_path_factory.mktemp("sp")
    (root / "one").mkdir()
    (root / "sp2").mkdir()
    one = [{"name": name, "preset": "tiny_cpu", "overrides": COMMON + extra + [
        "hardware.gpus_per_node=1", f"train.output_dir={root / 'one' / name}"]} for name, extra in RUNS.items()]
    one.append({"name": "logits_sft_packed_z2", "preset": "tiny_cpu", "overrides": COMMON + RUNS["sft_packed_z2"] + [
        "model.tiled_logits=4", "hardware.gpus_per_node=1", f"train.output_dir={root / 'one' / 'logits_sft_packed_z2'}"]})
    sp2 = [{"name": name, "preset": "tiny_cpu", "overrides": COMMON + extra + [
        "deepspeed.sequence_parallel_size=2", f"train.output_dir={root / 'sp2' / name}"]}
        for name, extra in RUNS.items()]
    resume = ["deepspeed.sequence_parallel_size=2", f"train.save_every={SAVE_AT}", "train.keep_last=5",
              "deepspeed.optimizer.params.torch_adam=true"] + STAGES["z2"]
    sp2 += [{"name": "straight", "preset": "tiny_cpu", "overrides": COMMON + resume + [
                f"train.output_dir={root / 'straight'}"]},
            {"name": "halves", "preset": "tiny_cpu", "overrides": COMMON + resume + [
                f"train.stop_after={SAVE_AT}", f"train.output_dir={root / 'halves'}"]},
            {"name": "halves resumed", "preset": "tiny_cpu", "overrides": COMMON + resume + [
                "train.resume=auto", f"train.output_dir={root / 'halves'}"]}]
    (root / "one").joinpath("output.txt").write_text(run_many(one, root / "one", ranks=1)[0])
    run_many(sp2, root / "sp2")
    return root, {name: (root / "one" / name, root / "sp2" / name) for name in RUNS}


@pytest.mark.multirank
@pytest.mark.parametrize("name", sorted(RUNS))
def test_sequence_parallel_matches_one_rank_step_by_step(sp_runs, name):
    one, sp2 = sp_runs[1][name]
    reference, sharded = losses(one), losses(sp2)
    assert len(reference) == len(sharded) == STEPS
    assert sharded == pytest.approx(reference, rel=1e-5)
    assert eval_losses(sp2) == pytest.approx(eval_losses(one), rel=1e-5)
    # the gradients themselves, not only what Adam makes of them: ZeRO-3's reduce-scatter once left them halved
    # (sequence_parallel.gradient_scale), which Adam's scale invariance turned into a drift of only 5e-5
    norms = [[row["grad_norm"] for row in read_metrics(run)[0]] for run in (one, sp2)]
    assert norms[1] == pytest.approx(norms[0], rel=1e-4)
    assert len(eval_losses(sp2)) == 2


TILED = ["pretrain_z3", "sft_packed_z2"]
CHECKPOINT_OFFLOAD = 'deepspeed.activation_checkpointing:={"partition_activations": false, "cpu_checkpointing": true}'
TILED_LOGITS = ["pretrain_z2", "sft_padded_z3"]  # both stages; padded SFT: shards predict unequal counts, some none


@pytest.fixture(scope="module")
def tiled_runs(sp_runs):
    """SP=2 with model.tiled_mlp=4, and with model.tiled_logits=4 (a launch of its own: its failure leaves the
    untiled results standing). Its output is kept in tiled/output.txt."""
    root, _ = sp_runs
    (root / "tiled").mkdir()
    runs = [{"name": name, "preset": "tiny_cpu", "overrides": COMMON + RUNS[name] + [
        "deepspeed.sequence_parallel_size=2", "model.tiled_mlp=4", f"train.output_dir={root / 'tiled' / name}"]}
        for name in TILED]
    runs += [{"name": f"logits_{name}", "preset": "tiny_cpu", "overrides": COMMON + RUNS[name] + [
        "deepspeed.sequence_parallel_size=2", "model.tiled_logits=4", f"train.output_dir={root / 'tiled' / name}_logits"]}
        for name in TILED_LOGITS]
    runs.append({"name": "checkpoint_offload", "preset": "tiny_cpu", "overrides": COMMON + RUNS["sft_packed_z2"] + [
        "deepspeed.sequence_parallel_size=2", "model.gradient_checkpointing=true", CHECKPOINT_OFFLOAD,
        f"train.output_dir={root / 'tiled' / 'checkpoint_offload'}"]})
    (root / "tiled" / "output.txt").write_text(run_many(runs, root / "tiled")[0])
    return root


@pytest.mark.multirank
@pytest.mark.parametrize("name", TILED)
def test_tiled_mlp_under_sequence_parallelism_matches_one_rank(sp_runs, tiled_runs, name):
    one, _ = sp_runs[1][name]
    assert losses(tiled_runs / "tiled" / name) == pytest.approx(losses(one), rel=1e-5)


@pytest.mark.multirank
def test_checkpoints_in_host_memory_train_as_one_rank_does(sp_runs, tiled_runs):
    """ALST's last piece, DeepSpeed's activation checkpoint offload (cpu_checkpointing, through deepspeed.checkpointing
    with Ulysses attention inside each recomputed layer): masked SFT at SP=2 gives one rank's losses step by step.
    On a CPU accelerator DeepSpeed keeps the checkpoints where they are, and the start-up line says so."""
    one, _ = sp_runs[1]["sft_packed_z2"]
    run = tiled_runs / "tiled" / "checkpoint_offload"
    assert "activation checkpoints in host memory (DeepSpeed cpu_checkpointing)" in (
        tiled_runs / "tiled" / "output.txt").read_text()
    assert losses(run) == pytest.approx(losses(one), rel=1e-5)
    assert eval_losses(run) == pytest.approx(eval_losses(one), rel=1e-5)


@pytest.mark.multirank
@pytest.mark.parametrize("name", TILED_LOGITS)
def test_tiled_logits_loss_gives_the_untiled_losses_under_sequence_parallelism(sp_runs, tiled_runs, name):
    """model.tiled_logits=4 (DeepSpeed's TiledFusedLogitsLoss: the LM head's backward runs inside the forward, so
    its gradient must get the accumulation and shard averaging there) trains as the untiled SP=2 run does, step by
    step, and so as one rank does; its eval_loss too."""
    one, untiled = sp_runs[1][name]
    tiled = tiled_runs / "tiled" / f"{name}_logits"
    assert "LM head and loss in 4 tiles" in (tiled_runs / "tiled" / "output.txt").read_text()
    assert len(losses(tiled)) == STEPS
    assert losses(tiled) == pytest.approx(losses(untiled), rel=1e-5)
    assert eval_losses(tiled) == pytest.approx(eval_losses(untiled), rel=1e-5)
    assert losses(tiled) == pytest.approx(losses(one), rel=1e-5)


@pytest.mark.multirank
def test_tiled_logits_loss_gives_the_model_own_loss_on_one_rank(sp_runs):
    """Without sequence parallelism the tiled path replaces transformers' own loss (masked SFT, ZeRO-2)."""
    root, runs = sp_runs
    assert "LM head and loss in 4 tiles" in (root / "one" / "output.txt").read_text()
    tiled = losses(root / "one" / "logits_sft_packed_z2")
    assert len(tiled) == STEPS and tiled == pytest.approx(losses(runs["sft_packed_z2"][0]), rel=1e-5)


def test_tiled_logits_are_on_by_default_for_long_sequences_only():
    """"auto": on once one rank's share of a sequence has 2^30 logits (Llama-3's 128k vocabulary: 8,372 tokens),
    a tile per GiB of the micro-batch's fp32 logits; off for short ones, where Liger's fused loss runs and under fp16."""
    from trainer.presets import load_preset
    from trainer.resolve import resolve

    def tiles(preset, *overrides):
        return resolve(load_preset(preset, list(overrides))).config.model.tiled_logits

    assert tiles("8b_128k_8xh100") == 8  # 16,384 tokens per rank x 128,256 x 4 B = 8.4 GB
    assert tiles("8b_128k_8xh100", "deepspeed.sequence_parallel_size=4", "train.micro_batch_size=1") == 16
    assert tiles("8b_128k_8xh100", "data.seq_len=65536") == 0  # 8,192 tokens per rank: below 2^30 logits
    assert tiles("8b_128k_8xh100", "model.tiled_logits=0") == 0  # asked off
    # Liger's fused cross-entropy avoids the logits only where it runs (trainer.loss_path): not on the shards'
    # forwards of sequence parallelism, which have no labels
    assert tiles("8b_128k_8xh100", "model.liger=true") == 8
    assert tiles("8b_128k_8xh100", "model.liger=true", "deepspeed.sequence_parallel_size=1", "data.seq_len=16384") == 0
    assert tiles("8b_128k_8xh100", "deepspeed.sequence_parallel_size=1", "data.seq_len=16384") > 1
    assert tiles("1b_pretrain_8xh100") == 0 and tiles("tiny_cpu") == 0
    # tied embeddings: a named error when asked (tests/rule_cases.py), so "auto" leaves it off
    assert tiles("8b_128k_8xh100", "model.tie_word_embeddings=true") == 0


def steps(run_dir) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in read_metrics(run_dir)[0]}


@pytest.mark.multirank
def test_a_sequence_parallel_run_resumes_exactly(sp_runs):
    root, _ = sp_runs
    straight, halves = steps(root / "straight"), steps(root / "halves")
    assert sorted(halves) == list(range(1, STEPS + 1))
    assert [halves[s] for s in sorted(halves)] == pytest.approx([straight[s] for s in sorted(straight)], rel=1e-6)


def test_a_sequence_parallel_checkpoint_on_another_layout_is_a_named_error(tmp_path):
    """Measured: DeepSpeed 0.19.8's universal conversion of an SP=2 checkpoint fails ('Checkpoint model-state file
    count 1 does not match pp_degree=1 * tp_degree=2': the Ulysses mpu is recorded as tensor parallelism), so a
    layout change is refused before anything loads, with the way out."""
    saved, now = Layout(2, 1, 1, 2, 2), Layout(1, 1, 1, 2, 1)
    with pytest.raises(ElasticResumeError, match="deepspeed.sequence_parallel_size=2 on 2 rank"):
        needs_universal(saved, now, tmp_path)
    assert not needs_universal(saved, saved, tmp_path)  # the same layout resumes as saved


def test_left_padding_is_refused_by_name():
    """Ulysses attends causally by position and drops the padding mask: right padding is exact, left is not."""
    check_right_padded(torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]))
    with pytest.raises(UserError, match="needs right padding.*deepspeed.sequence_parallel_size=1"):
        check_right_padded(torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]]))


def test_a_short_eval_batch_is_filled_with_rows_that_predict_nothing():
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "labels": torch.tensor([[5, 6, -100, -100]])}
    full = full_rows(batch, 3)
    assert full["input_ids"].tolist() == [[5, 6, 7, 8]] * 3
    assert full["labels"].tolist() == [[5, 6, -100, -100]] + [[-100] * 4] * 2
    assert batch["labels"].tolist() == [[5, 6, -100, -100]]  # the caller's batch is untouched


class SwiGLUWithoutActFn(torch.nn.Module):
    """The shape of Liger's LigerSwiGLUMLP (liger_kernel/transformers/swiglu.py, v0.8.5): gate/up/down projections
    and a fused SiLU-times-up function, no `act_fn` attribute (Liger's Triton kernel needs CUDA; this is its math)."""

    def __init__(self, mlp):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.slow  # 3-9 s in the quick tier's list of tests slower than 2 s (issue 36's 120 s budget)
@pytest.mark.parametrize("mlp", ["transformers", "liger-shaped"])
def test_tiled_mlps_give_the_untiled_loss_and_gradients(mlp):
    """model.tiled_mlp through DeepSpeed's TiledMLP on a real tiny Llama: same loss and gradients as untiled, with
    transformers' LlamaMLP and with an MLP shaped as Liger's (model.liger=true), which has no act_fn."""
    from transformers import AutoModelForCausalLM

    from trainer.model import hf_config
    from trainer.presets import load_preset
    from trainer.train.sequence_parallel import tile_mlps
    cfg = load_preset("tiny_cpu", TINY)
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(hf_config(cfg.model, "sdpa"))
    tiled = AutoModelForCausalLM.from_config(hf_config(cfg.model, "sdpa"))
    tiled.load_state_dict(plain.state_dict())
    if mlp == "liger-shaped":
        for layer in tiled.model.layers:
            layer.mlp = SwiGLUWithoutActFn(layer.mlp)
    assert tile_mlps(tiled, 4) == cfg.model.num_layers
    hidden = torch.randn(1, 8, cfg.model.hidden_size, requires_grad=True)
    assert "TiledMLP" in type(tiled.model.layers[0].mlp(hidden).grad_fn).__name__  # DeepSpeed's function runs it
    ids = torch.randint(0, cfg.model.vocab_size, (2, 64))
    results = []
    for model in (plain, tiled):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert float(loss_b) == pytest.approx(float(loss_a), rel=1e-6)
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("world, sp, seq_len", [(2, 2, 64), (1, 1, 64), (4, 4, 64)])
def test_the_long_context_preset_rehearses_with_the_ranks_present(tmp_path, world, sp, seq_len):
    """8b_128k_8xh100 declares sequence parallel 8 at 131,072 tokens: a rehearsal on fewer ranks shrinks the group
    to ranks it has and the samples to a short length each rank of the group divides, and says both."""
    from trainer import ds as dsc
    from trainer.presets import load_preset
    from trainer.resolve import resolve
    from trainer.train.rehearse import rehearsal_config
    cfg, notices = rehearsal_config(load_preset("8b_128k_8xh100", [f"train.output_dir={tmp_path}"]), world)
    assert (dsc.sequence_parallel_size(cfg.deepspeed), cfg.data.seq_len) == (sp, seq_len)
    assert f"sequence_parallel_size 8 -> {sp} (ranks present)" in notices
    assert any(n.startswith(f"data.seq_len 131072 -> {seq_len}") for n in notices) is (sp > 1)
    assert resolve(cfg).batch.sequence_parallel_size == sp  # and it resolves: heads and seq_len divide
    assert cfg.model.tiled_logits == 2 and any(n.startswith("model.tiled_logits auto -> 2") for n in notices)
