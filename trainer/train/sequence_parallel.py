"""Ulysses sequence parallelism (DeepSpeed's ALST), on DeepSpeed's own classes.

With `deepspeed.sequence_parallel_size` = sp > 1 the ranks form groups of sp consecutive ranks; a group trains on one
sample together, each rank holding seq_len / sp of its tokens:

  register          DeepSpeed's UlyssesSPAttentionHF takes over the model's attention (sdpa / flash) through
                    transformers' attention registry: before attention an all-to-all trades sequence shards for head
                    shards, so each rank attends over the whole sequence with heads / sp heads. It returns DeepSpeed's
                    mpu (parallel_state_sp), handed to deepspeed.initialize: gradients are then reduced over every
                    rank and divided by the data-parallel size world / sp, and ZeRO partitions over every rank.
  data              every rank of a group reads the same micro-batch (its data-parallel rank is the group's index),
                    then keeps its own slice of the sequence, as DeepSpeed's UlyssesSPDataLoaderAdapter shards it:
                    labels shifted by one *before* sharding (a shard's last token predicts the next shard's first),
                    position ids global (Ulysses gathers them to build the causal order). Padding is on the right
                    (SFT), so the causal mask Ulysses uses sees exactly the tokens the padding mask would.
  loss              sum of this shard's per-token losses over the group's count of predicted tokens (SFT masks make
                    shards unequal: a shard may predict nothing). DeepSpeed sums the shards' gradients, which is the
                    gradient of the sample's mean loss; the value every rank reports is the group's whole loss.

`loss_of` is what the loop and eval call for a micro-batch's loss, with or without sequence parallelism.
`tile_mlps` (model.tiled_mlp, with or without SP) runs the MLPs through DeepSpeed's TiledMLP; model.tiled_logits
runs the LM head and loss through DeepSpeed's TiledFusedLogitsLoss (`tiled_loss_sum`), with or without SP.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import ds as dsc
from .. import loss_path
from ..config import Config
from ..errors import UserError
from ..resolve import even_tiles

IGNORE_INDEX = -100  # transformers' (and DeepSpeed's adapter's) label for tokens without a loss


_REPLACED: dict = {}  # attention implementation -> transformers' function that Ulysses' wrapper replaced


def register(model, cfg: Config):
    """DeepSpeed's Ulysses attention registered for `model`; its mpu for deepspeed.initialize (None without SP).
    After the process group is up and before deepspeed.initialize; `release` first when a run came before."""
    sp = dsc.sequence_parallel_size(cfg.deepspeed)
    if sp == 1:
        return None
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    attention = model.config._attn_implementation
    _REPLACED[attention] = ALL_ATTENTION_FUNCTIONS[attention]
    return UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation=attention,
        sequence_parallel_size=sp, micro_batch_size=cfg.train.micro_batch_size, seq_length=cfg.data.seq_len,
        seq_length_is_variable=False)  # every batch is seq_len long (windows, or SFT padded to it)


def tile_mlps(model, tiles: int) -> int:
    """model.tiled_mlp: each MLP of `model` (gate/up/down projections, as Llama, Mistral and Qwen2 have, with
    transformers' or Liger's SwiGLU) runs through DeepSpeed's TiledMLP in `tiles` pieces along the sequence; returns
    how many MLPs were tiled. Rows of an MLP are independent, so the result is the untiled one; TiledMLP tells ZeRO
    when a weight's gradient is whole."""
    if tiles < 2:
        return 0
    mlps = [m for m in model.modules() if all(hasattr(m, name) for name in ("gate_proj", "up_proj", "down_proj"))]
    for mlp in mlps:  # this instance only, not the class; tiles the forward it has now (Liger's if patched)
        mlp.forward = functools.partial(_tiled_mlp_forward, mlp.forward, mlp, tiles)
    return len(mlps)


def tiling_in_use(tiled_mlps: int, model_cfg) -> str:
    """For the start-up log: what runs tiled along the sequence ('' when nothing does)."""
    parts = [f"{tiled_mlps} MLPs in {model_cfg.tiled_mlp} tiles"] if tiled_mlps else []
    if (model_cfg.tiled_logits or 0) >= 2:
        parts.append(f"LM head and loss in {model_cfg.tiled_logits} tiles")
    return f"; tiled (DeepSpeed ALST): {', '.join(parts)}" if parts else ""


def _tiled_mlp_forward(untiled, mlp, tiles: int, x: torch.Tensor) -> torch.Tensor:
    """`untiled` (the MLP's own forward: transformers' LlamaMLP, Liger's LigerSwiGLUMLP, ...) run by TiledMLP."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
    # no more tiles than tokens: TiledMLP marks a weight's gradient whole at its last tile, which must exist
    return TiledMLP.apply(lambda _, shard: untiled(shard), mlp, x, min(tiles, x.shape[-2]), list(mlp.parameters()))


def release() -> None:
    """Undo an earlier run's registration in this process (tests train several runs per launch): transformers'
    attention functions back, DeepSpeed's sequence-parallel groups and mpu dropped (DeepSpeed keeps them in module
    globals, and refuses to build the groups twice)."""
    if not _REPLACED:
        return
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.utils import groups
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    for attention, function in _REPLACED.items():
        ALL_ATTENTION_FUNCTIONS[attention] = function
    _REPLACED.clear()
    parallel_state_sp._release_sequence_parallel_groups()  # DeepSpeed's own reset (it calls it at teardown)
    if groups.mpu is parallel_state_sp:
        groups.mpu = None


def sequence_parallel_size(engine) -> int:
    return int(getattr(engine, "sequence_parallel_size", 1) or 1)  # set by DeepSpeed from the mpu


def data_parallel_rank(engine) -> int:
    """Which data-parallel replica this rank belongs to: its SP group's index (the group reads one sample).
    DeepSpeed's parallel_state_sp groups consecutive ranks; checked rather than assumed."""
    sp = sequence_parallel_size(engine)
    members = dist.get_process_group_ranks(engine.get_sequence_parallel_group())
    if members != list(range(members[0], members[0] + sp)) or members[0] % sp:
        raise RuntimeError(f"DeepSpeed's sequence-parallel group {members} is not {sp} consecutive ranks: the data "
                           f"layout (group index = rank // {sp}) would give its ranks different samples")
    return members[0] // sp


def loss_of(engine, batch: dict, logits_tiles: int = 0) -> torch.Tensor:
    """The micro-batch's mean loss over its predicted tokens, on every rank of a sequence-parallel group alike
    (its gradient is this rank's share), on the path trainer.loss_path decides (`causal_path`): the model's own loss
    (with labels: Liger's fused loss where Liger is applied), tiled (`logits_tiles` >= 2, model.tiled_logits:
    tiled_loss_sum) or on this rank's full logits (sequence parallelism)."""
    sp, path = sequence_parallel_size(engine), causal_path(engine, logits_tiles)
    if path in (loss_path.FUSED, loss_path.MODEL):
        return engine(**forward_inputs(engine.module, batch)).loss
    inputs, shift_labels, predicted = model_inputs(engine, batch, sp)
    scale = gradient_scale(engine, sp)
    if path == loss_path.TILED:  # dividing by predicted / scale: the tiles' in-forward gradients get the scale too
        scaled = tiled_loss_sum(engine, inputs, shift_labels, logits_tiles, predicted / scale)
    else:
        logits = engine(**inputs).logits
        scaled = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shift_labels.reshape(-1),
                                 ignore_index=IGNORE_INDEX, reduction="sum") / predicted * scale
    if sp == 1:
        return scaled
    whole = scaled.detach() / scale
    dist.all_reduce(whole, group=engine.get_sequence_parallel_group())
    return scaled + (whole - scaled.detach())  # the value of the whole, the gradient of this rank's share x scale


def causal_path(engine, logits_tiles: int) -> str:
    """trainer.loss_path's decision for this engine's pretraining/SFT forward: Liger as really applied to its model,
    its ZeRO stage and sequence-parallel size, the resolved tiles (what the planner decides from the config)."""
    from ..model import liger_applied, unwrap
    return loss_path.loss_path("causal", liger_applied(unwrap(engine)), engine.zero_optimization_stage(),
                               sequence_parallel_size(engine), logits_tiles)


def forward_inputs(model, batch: dict) -> dict:
    """The model's keyword arguments for a data batch. Isolated documents (position ids, no attention mask:
    data/samples.py) stay apart only if transformers 5.24 sees the position-id restarts: sdpa/eager/flex build their
    block-diagonal mask from them only without a KV cache (masking_utils._preprocess_mask_arguments), so the cache is
    off; flash-attn separates them only in a single row (modeling_flash_attention_utils._is_packed_sequence needs
    batch size 1), so its rows are laid end to end (`as_one_row`; each document's first label is -100, so no token
    predicts across a seam)."""
    from ..model import attention_in_use
    if "position_ids" not in batch or "attention_mask" in batch:
        return batch
    batch = {**batch, "use_cache": False}
    return as_one_row(batch) if attention_in_use(model) == "flash_attention_2" else batch


def as_one_row(batch: dict) -> dict:
    """The rows of `batch` one after another in a single row."""
    return {key: value.reshape(1, -1) if key in ("input_ids", "labels", "position_ids") else value
            for key, value in batch.items()}


def gradient_scale(engine, sp: int) -> int:
    """What this rank's loss gradient is multiplied by so that DeepSpeed's reduction leaves the group's sum of
    shard gradients averaged over data-parallel replicas (world / sp). ZeRO-1/2, and ZeRO-3's all-reduce path,
    divide the summed gradients by world / sp (stage_1_and_2.py, stage3.py __avg_scatter_contiguous_grads); ZeRO-3's
    reduce-scatter path (zero_optimization.reduce_scatter, on by default) averages over the whole world
    (comm/coalesced_collectives.py reduce_scatter_coalesced: div_(world_sz)) and never multiplies sp back
    (stage3.py __avg_scatter_grads, DeepSpeed 0.19.8): its gradients came out sp times too small (grad_norm halved
    at SP=2: clipping and Adam's epsilon then made pretraining drift 5.4e-5 from one rank by step 4)."""
    if sp > 1 and engine.zero_optimization_stage() == 3 and engine.zero_reduce_scatter():
        return sp
    return 1


def model_inputs(engine, batch: dict, sp: int) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """(the model's inputs for this rank, its labels shifted by one, the count of predicted tokens of the whole
    micro-batch). Under sequence parallelism this rank's slice of the sequence (module docstring)."""
    shift_labels = F.pad(batch["labels"], (0, 1), value=IGNORE_INDEX)[:, 1:]  # before sharding, as DeepSpeed's adapter
    if sp == 1:  # isolated documents for flash-attn: one row, the shifted labels laid out alike (forward_inputs)
        inputs = forward_inputs(engine.module, {key: value for key, value in batch.items() if key != "labels"})
        rows = inputs["input_ids"].shape[0]
        return {**inputs, "use_cache": False}, shift_labels.reshape(rows, -1), _predicted(shift_labels)
    group = engine.get_sequence_parallel_group()
    batch = full_rows(batch, engine.train_micro_batch_size_per_gpu())
    check_right_padded(batch.get("attention_mask"))
    check_one_sample_per_group(batch["input_ids"], group)
    shift_labels = F.pad(batch["labels"], (0, 1), value=IGNORE_INDEX)[:, 1:]
    input_ids = batch["input_ids"]
    rows, length = input_ids.shape
    positions = batch.get("position_ids")  # restarting per document where documents are isolated (data/samples.py)
    if positions is None:
        positions = torch.arange(length, device=input_ids.device).expand(rows, length)
    chunk = length // sp
    mine = slice(dist.get_rank(group) * chunk, (dist.get_rank(group) + 1) * chunk)
    inputs = {"input_ids": input_ids[:, mine], "position_ids": positions[:, mine], "use_cache": False}
    return inputs, shift_labels[:, mine], _predicted(shift_labels)  # the group's count: every rank holds the batch


def _predicted(shift_labels: torch.Tensor) -> torch.Tensor:
    return (shift_labels != IGNORE_INDEX).sum().clamp(min=1)  # a micro-batch that predicts nothing has loss 0


def tiled_loss_sum(engine, inputs: dict, shift_labels: torch.Tensor, tiles: int, predicted) -> torch.Tensor:
    """Sum of this rank's token losses / `predicted` (a count, or a count over a gradient scale), through DeepSpeed's TiledFusedLogitsLoss: the LM head and the
    cross-entropy run on `tiles` slices of the hidden states, so one slice's logits exist at a time.

    The model runs through the engine (DeepSpeed's forward hooks, its backward prologue on the outputs) with no
    logits (transformers' logits_to_keep, an empty index) and returns its final hidden states. TiledFusedLogitsLoss
    runs each tile's backward inside its forward: the LM head's gradient is final before engine.backward, which
    divides the loss by the accumulation steps only afterwards, for what flows into the body. So each tile's loss is
    divided by them here and the result multiplied back: the value is unchanged, every gradient gets the division
    once. (fp16's loss scale would be missed the same way: rules.py refuses tiles with fp16.)"""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss
    model = engine.module.get_base_model() if hasattr(engine.module, "get_base_model") else engine.module  # PEFT
    head = model.get_output_embeddings()
    no_positions = torch.empty(0, dtype=torch.long, device=shift_labels.device)
    hidden = engine(**inputs, output_hidden_states=True, logits_to_keep=no_positions).hidden_states[-1]
    steps = engine.gradient_accumulation_steps()

    def tile_loss(head, x, y):
        return F.cross_entropy(head(x).float(), y, ignore_index=IGNORE_INDEX, reduction="sum") / (predicted * steps)

    head_weights = [p for p in head.parameters() if p.requires_grad]
    tiles = even_tiles(hidden.shape[0] * hidden.shape[1], tiles)
    return steps * TiledFusedLogitsLoss.apply(tile_loss, head, hidden, shift_labels, None, tiles, head_weights, "sum")


def check_one_sample_per_group(input_ids: torch.Tensor, group) -> None:
    """Every rank of a sequence-parallel group must hold the same micro-batch (each keeps its slice of it). A
    loader that shards over all ranks, or shuffles per rank, hands them different samples: attention would then
    mix slices of unrelated sequences, silently. One small all-gather per micro-batch (next to Ulysses' four
    all-to-alls per layer) compares a fingerprint of the token ids."""
    weights = torch.arange(1, input_ids.numel() + 1, device=input_ids.device).view_as(input_ids)
    mine = (input_ids.long() * weights).sum().view(1)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    if any(int(other) != int(mine) for other in everyone):
        members = dist.get_process_group_ranks(group)
        raise UserError(f"the ranks {members} of a sequence-parallel group hold different samples: a group trains on "
                        f"one sample, each rank on its slice, so its ranks must read the same micro-batch - shard the "
                        f"data by data-parallel rank (rank // sequence_parallel_size), not by rank, and do not "
                        f"shuffle per rank (the trainer's own loader does this; a loader of your own must too)")


def full_rows(batch: dict, rows: int) -> dict:
    """`batch` with `rows` rows: Ulysses' attention has a fixed micro-batch shape, and eval's last batch may be
    short. Added rows repeat the first with no label, so they change no loss."""
    missing = rows - batch["input_ids"].shape[0]
    if missing <= 0:
        return batch
    out = {key: torch.cat([value, value[:1].expand(missing, *value.shape[1:])]) for key, value in batch.items()}
    out["labels"][-missing:] = IGNORE_INDEX
    return out


def check_right_padded(mask) -> None:
    """Ulysses drops the padding mask and attends causally by position: exact only when padding follows the text."""
    if mask is not None and bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise UserError("sequence parallelism needs right padding (text first, padding after): this batch has padding "
                        "before text, which Ulysses' causal attention would attend to; set "
                        "deepspeed.sequence_parallel_size=1 for this data")
