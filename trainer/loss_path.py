"""Which loss path a training forward runs: one decision, read by the code that runs it and by the planner.

The logits are the largest tensors of a step at long sequences or large vocabularies, and whether they exist at all
depends on how the forward is called, not on what the preset asks for:

  liger-fused  the model's forward gets labels in training mode with Liger's fused linear cross-entropy patched in
               (model.liger, below ZeRO-3): the loss is computed chunk by chunk, the s.b.V logits never exist
  model        the model's forward gets labels and computes its own loss on full logits (transformers' cross-entropy,
               or Liger's, on this model only, under ZeRO-3: trainer.model.liger_loss_function)
  tiled        DeepSpeed's TiledFusedLogitsLoss (model.tiled_logits >= 2): the model returns hidden states, the LM head
               and loss run one tile at a time
  logits       the model returns full logits without labels and the trainer computes the loss on them: sequence
               parallelism without tiles (each rank's shard), the DPO policy and the reference model (per-sequence
               log-probs). Liger's fused loss never runs here: Liger's forward builds the logits when it has no
               labels, so model.liger saves nothing on these forwards.

`forward` names which forward: "causal" (pretraining and SFT, training and eval), "policy" and "reference" (DPO).
train.sequence_parallel.loss_of dispatches on `loss_path`, train.preference calls the model without labels (what
"policy"/"reference" mean here), and plan.memory.logits_bytes prices each path; tests/test_loss_path.py runs every
objective and checks that the forward it makes is the one this module says.
"""
from __future__ import annotations

FUSED = "liger-fused"
MODEL = "model"
TILED = "tiled"
LOGITS = "logits"

FORWARDS = ("causal", "policy", "reference")


def loss_path(forward: str, liger: bool, zero_stage: int, sequence_parallel: int = 1, logits_tiles: int = 0) -> str:
    """The path of `forward` for a model with Liger applied (`liger`: the kernels really patched in, or for the
    planner, asked for on a GPU) at this ZeRO stage, sequence-parallel size and number of logits tiles."""
    if forward not in FORWARDS:
        raise ValueError(f"forward {forward!r} is not one of {FORWARDS}")
    if forward != "causal":
        return LOGITS
    if logits_tiles >= 2:
        return TILED
    if sequence_parallel > 1:
        return LOGITS
    if liger and zero_stage != 3:
        return FUSED
    return MODEL


def fused_loss_possible(task: str, liger: bool, zero_stage: int, sequence_parallel: int) -> bool:
    """Would Liger's fused loss run for this run's training forward without tiles? (Tiles are then pointless:
    resolve.auto_logits_tiles leaves them off.)"""
    forward = "policy" if task in ("preference", "grpo") else "causal"
    return loss_path(forward, liger, zero_stage, sequence_parallel) == FUSED


def loss_kernel(path: str, liger: bool) -> str:
    """The loss kernel that runs on `path`, for the start-up line."""
    return {FUSED: "Liger fused linear cross-entropy (no logits tensor)",
            MODEL: "Liger cross-entropy on this model's logits" if liger else "torch cross-entropy on full logits",
            TILED: "DeepSpeed TiledFusedLogitsLoss (torch cross-entropy per tile)",
            LOGITS: "torch cross-entropy / log-softmax on full logits"}[path]
