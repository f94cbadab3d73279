"""`--rehearse`: run a preset's exact DeepSpeed features on a toy model with the ranks present.

Kept: ZeRO stage, offload devices (CPU/NVMe), AutoTP, AutoEP (its size cut to divide the ranks present), hpZ, quantized gradients, activation
checkpointing, optimizer, scheduler, checkpointing, export, the task (pretrain/SFT/LoRA).
Changed, each with a one-line notice: the model shrinks to 2 layers of the same architecture
(heads, GQA ratio, tied embeddings kept), pretrained weights are replaced by a random init of the
shrunk model (saved to disk first when the preset fine-tunes, so the loading path runs too),
data/tokenizer become the shipped tiny set of the same task when the preset's are not local (SFT:
chat messages, as the shipped SFT presets read; the tiny tokenizer loses its chat template when the
preset's tokenizer may have none and data.chat_template is unset, so that mistake stops here too),
bf16/fp16 -> fp32 and quantized weights off on CPU, flash-attn -> sdpa, the NVMe path -> a local
directory, the world size -> the ranks present (a sequence-parallel size with it, and seq_len to a multiple
of it), a few steps with an eval and a save.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch

from .. import ds as dsc
from .. import ranks
from ..config import Config, DataConfig
from ..presets import REPO_ROOT


TINY = REPO_ROOT / "data" / "tiny"
# SFT rehearses chat messages: the shipped SFT presets read them, and they are the format that needs
# the most of the tokenizer (a chat template, prefix-stable, a fast tokenizer). A preset with local
# prompt/response data keeps its own (tiny_data).
TINY_DATA = {"pretrain": TINY / "pretrain.jsonl", "sft": TINY / "chat.jsonl",
             "preference": TINY / "preference.jsonl",  # right answers chosen over wrong ones of the same kind
             "grpo": REPO_ROOT / "data" / "tiny_grpo" / "train.jsonl"}  # digit sums with their answers


def rehearsal_config(cfg: Config, world_size: int, explicit: set[str] = frozenset()) -> tuple[Config, list[str]]:
    """The rehearsal of `cfg`; train settings the user gave with `--set` (`explicit`: dotted keys) are kept, as
    `--set` outranks everything else (README precedence), the rehearsal's own choices included."""
    on_cpu = not torch.cuda.is_available()
    run_dir = Path(cfg.train.output_dir if "train.output_dir" in explicit
                   else Path(cfg.train.output_dir).parent / f"rehearse_{cfg.name}")
    notices = [f"rehearsal of {cfg.name}: model shrunk to 2 layers, {world_size} rank(s), 6 steps, "
               f"output in {run_dir}"]
    model = shrink_model(cfg, notices)
    model = dataclasses.replace(model, tokenizer=tiny_tokenizer(cfg, run_dir, notices),
                                tiled_logits=kept_logits_tiling(cfg, notices))
    ds, ds_notices = dsc.rehearsal_changes(cfg.deepspeed, world_size, str(run_dir / "nvme"), on_cpu)
    data = tiny_data(cfg, dsc.sequence_parallel_size(ds), notices)
    notices += ds_notices
    if dsc.nvme_offloads(ds):  # the rehearsal's NVMe stand-in must exist to resolve; made only when it is used
        (run_dir / "nvme").mkdir(parents=True, exist_ok=True)
    precision = cfg.train.precision
    if on_cpu and precision != "fp32":
        notices.append(f"{precision} -> fp32 (CPU ranks)")
        precision = "fp32"
    shrunk = dict(micro_batch_size=2, grad_accum=min(2, cfg.train.grad_accum or 1), global_batch_size=None,
                  precision=precision, max_steps=6, warmup_steps=2 if "train.max_steps" not in explicit
                  else min(2, cfg.train.max_steps), eval_every=3, eval_sequences=8, save_every=3,
                  keep_last=2, output_dir=str(run_dir))
    kept = sorted(key for key in shrunk if f"train.{key}" in explicit)
    if kept:
        notices.append(f"kept from --set: {', '.join(f'train.{k}={getattr(cfg.train, k)}' for k in kept)}")
    train = dataclasses.replace(cfg.train, **{k: v for k, v in shrunk.items() if k not in kept})
    hardware = dataclasses.replace(cfg.hardware, gpu="cpu" if on_cpu else cfg.hardware.gpu,
                                   gpus_per_node=world_size, nodes=1)
    logging = dataclasses.replace(cfg.logging, wandb_mode="disabled", log_every=1)
    rehearsed = dataclasses.replace(cfg, model=model, data=data, train=train, hardware=hardware, logging=logging,
                                    deepspeed=ds, grpo=rehearsal_grpo(cfg, data.seq_len, train.micro_batch_size, notices))
    if model.lora.enabled:
        rehearsed = with_saved_base_model(rehearsed, run_dir / "base_model", notices)
    return rehearsed, notices


def rehearsal_grpo(cfg: Config, seq_len: int, micro_batch: int, notices: list[str]):
    """GRPO keeps its loss, rewards, sampling and reference; the group and the completions shrink to the rehearsal's
    micro-batch and sequence (a group must fit a micro-batch, a completion the sequence)."""
    g = cfg.grpo
    if cfg.data.task != "grpo":
        return g
    group, new_tokens = 2 if micro_batch % 2 == 0 else micro_batch, min(g.max_new_tokens, 8, seq_len // 2)
    notices.append(f"grpo.num_generations {g.num_generations} -> {group}, grpo.max_new_tokens {g.max_new_tokens} -> "
                   f"{new_tokens} (the rehearsal's micro-batch and sequence)")
    return dataclasses.replace(g, num_generations=group, max_new_tokens=new_tokens)


def shrink_model(cfg: Config, notices: list[str]):
    m = cfg.model
    heads = min(m.num_heads, 4)
    kv_ratio = m.num_heads // (m.num_kv_heads or m.num_heads)
    kv_heads = max(1, heads // kv_ratio)
    hidden = 16 * heads
    attention = m.attn_implementation
    if attention == "flash_attention_2" and not torch.cuda.is_available():
        notices.append("flash_attention_2 -> sdpa (no CUDA)")
        attention = "sdpa"
    if m.name_or_path:
        notices.append(f"pretrained weights {m.name_or_path} -> random init of the shrunk model")
    if m.head_dim:
        notices.append(f"head_dim {m.head_dim} -> {hidden // heads} (hidden / heads of the shrunk model)")
    return dataclasses.replace(m, name_or_path=None, hidden_size=hidden, head_dim=None,
                               num_layers=2, num_heads=heads, num_kv_heads=kv_heads,
                               intermediate_size=int(hidden * m.intermediate_size / m.hidden_size) // 8 * 8 or 8,
                               vocab_size=1024, max_position_embeddings=256, attn_implementation=attention)


def kept_logits_tiling(cfg: Config, notices: list[str]):
    """model.tiled_logits "auto" turns on for the preset's long samples but would stay off for the rehearsal's short
    ones: the rehearsal asks for 2 tiles instead, so the tiled loss path runs too."""
    from ..resolve import auto_logits_tiles
    tiles = cfg.model.tiled_logits
    if tiles is not None or not auto_logits_tiles(cfg.model, cfg.data.seq_len, dsc.sequence_parallel_size(cfg.deepspeed),
                                                  cfg.train.micro_batch_size, cfg.train.precision, cfg.data.task,
                                                  dsc.zero_stage(cfg.deepspeed)):
        return tiles
    notices.append("model.tiled_logits auto -> 2 (the preset's samples are long enough to tile their logits; the "
                   "rehearsal's are not, so it asks)")
    return 2


def tiny_data(cfg: Config, sequence_parallel: int, notices: list[str]):
    d = cfg.data
    seq_len = rehearsal_seq_len(d.seq_len, sequence_parallel, notices)
    if Path(d.source).exists():
        return dataclasses.replace(d, seq_len=seq_len)
    kind = {"sft": "chat messages", "preference": "prompt/chosen/rejected pairs",
            "grpo": "prompt/answer records"}.get(d.task, "text")
    notices.append(f"data {d.source} -> {TINY_DATA[d.task]} (shipped tiny {d.task} data: {kind})")
    default = DataConfig()  # the tiny set's columns have the default names, whatever the preset's data calls them
    columns = {name: getattr(default, name) for name in ("text_field", "prompt_field", "response_field",
                                                         "messages_field", "chosen_field", "rejected_field",
                                                         "answer_field")}
    return dataclasses.replace(d, source=str(TINY_DATA[d.task]), eval_source=None, seq_len=seq_len, num_workers=1,
                               eval_fraction=0.05 if d.task != "grpo" else 0.1, subset=None, **columns)


def rehearsal_seq_len(seq_len: int, sequence_parallel: int, notices: list[str]) -> int:
    """At most 64 tokens (a toy model), a multiple of the rehearsal's sequence-parallel size: each rank of a
    Ulysses group holds seq_len / sp of them."""
    short = max(min(seq_len, 64) // sequence_parallel * sequence_parallel, sequence_parallel)
    if sequence_parallel > 1 and short != seq_len:
        notices.append(f"data.seq_len {seq_len} -> {short} ({short // sequence_parallel} tokens on each of the "
                       f"{sequence_parallel} ranks of a sequence-parallel group)")
    return short


def tiny_tokenizer(cfg: Config, run_dir: Path, notices: list[str]) -> str:
    """The shipped tiny tokenizer, or a copy of it without its chat template (written to the rehearsal
    directory) when the preset's own tokenizer may have none: the real run would then stop at data
    preparation ("no chat_template; set data.chat_template"), and the rehearsal must stop there too
    rather than pass on the tiny tokenizer's template. data.chat_template, when set, is applied to
    either one later, as in the real run."""
    from ..data.tokenize import has_chat_template_on_disk
    tiny, preset_tokenizer = TINY / "tokenizer", cfg.model.tokenizer or cfg.model.name_or_path
    if cfg.data.task == "grpo" and preset_tokenizer and small_local_tokenizer(preset_tokenizer):
        return preset_tokenizer  # GRPO prompts are sized for their own tokenizer (data.seq_len - max_new_tokens)
    if (cfg.data.task != "sft" or cfg.data.chat_template is not None or not preset_tokenizer
            or has_chat_template_on_disk(preset_tokenizer)):
        return str(tiny)
    path = run_dir / "tokenizer_without_chat_template"
    if ranks.rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        config = json.loads((tiny / "tokenizer_config.json").read_text(encoding="utf-8"))
        config.pop("chat_template", None)
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
        shutil.copyfile(tiny / "tokenizer.json", path / "tokenizer.json")
    ranks.barrier()
    notices.append(f"tokenizer {preset_tokenizer} -> the tiny tokenizer without its chat template ({path}): "
                   f"{preset_tokenizer} may have none (base checkpoints ship none) and data.chat_template is unset")
    return str(path)


def small_local_tokenizer(path: str) -> bool:
    """A local tokenizer the shrunk model's 1024-token vocabulary holds."""
    if not Path(path).is_dir():
        return False
    from transformers import AutoTokenizer

    from ..remote_code import load_kwargs
    try:  # a size probe: never the directory's own code
        return len(AutoTokenizer.from_pretrained(path, **load_kwargs(False, path, "tokenizer"))) <= 1024
    except Exception:  # noqa: BLE001 - not a tokenizer this check can read: the tiny one is used instead
        return False


def with_saved_base_model(cfg: Config, path: Path, notices: list[str]) -> Config:
    """LoRA needs pretrained weights: save a random init of the shrunk model once, then load it as one."""
    from ..model import hf_config, init_weights_by_name
    rank = ranks.rank()
    if rank == 0 and not (path / "config.json").exists():
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_config(hf_config(cfg.model, "sdpa"))
        init_weights_by_name(model, cfg.train.seed, cfg.model.init_std, rank=0)
        model.save_pretrained(str(path))
    ranks.barrier()
    notices.append(f"LoRA base model -> {path} (random init, saved for the rehearsal)")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name_or_path=str(path)))
