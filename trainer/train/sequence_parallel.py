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
`tile_mlps` (model.tiled_mlp, with or without SP) runs the MLPs through DeepSpeed's TiledMLP.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import ds as dsc
from ..config import Config
from ..errors import UserError

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
    """model.tiled_mlp: each MLP of `model` (gate/up/down projections, as Llama, Mistral and Qwen2 have) runs through
    DeepSpeed's TiledMLP in `tiles` pieces along the sequence; returns how many MLPs were tiled. Rows of an MLP are
    independent, so the result is the untiled one; TiledMLP tells ZeRO when a weight's gradient is whole."""
    if tiles < 2:
        return 0
    mlps = [m for m in model.modules() if all(hasattr(m, name) for name in ("gate_proj", "up_proj", "down_proj",
                                                                             "act_fn"))]
    for mlp in mlps:
        mlp.forward = functools.partial(_tiled_mlp_forward, mlp, tiles)  # this instance only, not the class
    return len(mlps)


def _tiled_mlp_forward(mlp, tiles: int, x: torch.Tensor) -> torch.Tensor:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
    # no more tiles than tokens: TiledMLP marks a weight's gradient whole at its last tile, which must exist
    return TiledMLP.apply(_mlp, mlp, x, min(tiles, x.shape[-2]), list(mlp.parameters()))


def _mlp(mlp, x: torch.Tensor) -> torch.Tensor:
    return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))


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


def loss_of(engine, batch: dict) -> torch.Tensor:
    """The micro-batch's mean loss over its predicted tokens, on every rank of a sequence-parallel group alike
    (its gradient is this rank's share); without sequence parallelism, the model's own loss."""
    if sequence_parallel_size(engine) == 1:
        return engine(**batch).loss
    group = engine.get_sequence_parallel_group()
    sp, sp_rank = dist.get_world_size(group), dist.get_rank(group)
    batch = full_rows(batch, engine.train_micro_batch_size_per_gpu())
    check_right_padded(batch.get("attention_mask"))
    input_ids, labels = batch["input_ids"], batch["labels"]
    rows, length = input_ids.shape
    shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]  # before sharding, as DeepSpeed's adapter does
    positions = torch.arange(length, device=input_ids.device).expand(rows, length)
    chunk = length // sp
    mine = slice(sp_rank * chunk, (sp_rank + 1) * chunk)
    logits = engine(input_ids=input_ids[:, mine], position_ids=positions[:, mine], use_cache=False).logits
    shard_sum = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shift_labels[:, mine].reshape(-1),
                                ignore_index=IGNORE_INDEX, reduction="sum")
    share = shard_sum / (shift_labels != IGNORE_INDEX).sum()  # the group's count: every rank holds the whole batch
    whole = share.detach().clone()
    dist.all_reduce(whole, group=group)
    return share + (whole - share.detach())  # the value of the whole, the gradient of this rank's share


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
