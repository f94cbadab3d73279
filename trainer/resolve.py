"""Config -> Resolved: "auto" filled, batch triad solved, everything validated, all problems at once.

The only function most callers need is `resolve(config, world_size)`. Its result is what the loop,
`show`, `export`, the planner and the linter read; it holds no "auto".
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field

from . import ds as dsc
from . import strict, text
from .loss_path import fused_loss_possible
from .config import AUTO, Config
from .errors import ConfigError, short
from .hardware import GPUS, TABLE, canonical_name, unknown_hint
from .named_inputs import named_input_problems
from .paths import CONTROL, control_characters
from .redact import redact
from .rules import check_rules, notices



@dataclass(frozen=True)
class Resolved:
    config: Config          # train batch fields are ints; deepspeed is the filled DeepSpeed dict
    world_size: int
    batch: dsc.Batch
    notices: list[str] = field(default_factory=list)

    @property
    def ds(self) -> dict:
        return self.config.deepspeed

    @property
    def tokens_per_step(self) -> int:
        sequences = 2 if self.config.data.task == "preference" else 1  # a preference sample is a pair of sequences
        return self.batch.global_batch_size * self.config.data.seq_len * sequences

    def as_dict(self) -> dict:
        """The resolved config as plain YAML/JSON data (tuples become lists)."""
        return _plain(dataclasses.asdict(self.config))

    def document(self) -> dict:
        """What `show` prints and the run directory keeps: the config plus the derived numbers."""
        return {**self.as_dict(), "derived": self.summary()}

    def record(self) -> dict:
        """What the run directory, wandb and every checkpoint keep: the document, secrets redacted."""
        return redact(self.document())

    def summary(self) -> dict:
        """Derived numbers shown by `show`."""
        return {
            "world_size": self.world_size,
            "data_parallel_size": self.batch.data_parallel_size,
            "autotp_size": dsc.autotp_size(self.ds),
            "expert_parallel_size": dsc.autoep_size(self.ds),
            "sequence_parallel_size": self.batch.sequence_parallel_size,
            "zero_stage": dsc.zero_stage(self.ds),
            "offload": {"optimizer": dsc.offload_optimizer_device(self.ds), "param": dsc.offload_param_device(self.ds)},
            "precision": dsc.precision(self.ds),
            "global_batch_size": self.batch.global_batch_size,
            "tokens_per_step": self.tokens_per_step,
            "total_tokens": self.tokens_per_step * self.config.train.max_steps,
        }


def declared_world_size(cfg: Config) -> int:
    return cfg.hardware.nodes * cfg.hardware.gpus_per_node


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def launcher_world_size() -> int | None:
    """WORLD_SIZE set by deepspeed/torchrun, or None outside a launcher (trainer/ranks.py reads the variables)."""
    from . import ranks
    launch = ranks.launch_environment()
    return launch.world_size if launch else None


def resolve(cfg: Config, world_size: int | None = None, source: str = "") -> Resolved:
    cfg = _canonical_gpu_name(cfg)
    cfg, adopted = adopt_pretrained_architecture(cfg)
    world = declared_world_size(cfg) if world_size is None else world_size  # an explicit 0 is an error, not "unset"
    problems = check_values(cfg)
    if world < 1:
        problems.append(f"--world-size {world}: the world size must be >= 1 (or leave the flag out: "
                        f"hardware.nodes x hardware.gpus_per_node)" if world_size is not None else
                        f"world size {world} must be >= 1")
    problems += dsc.check_keys(cfg.deepspeed, typed=False)
    if problems:  # the steps below assume well-typed input
        raise ConfigError(problems, source or cfg.name)
    batch = dsc.solve_batch(cfg, world, problems)
    ds = dsc.fill_auto(cfg, batch, problems) if batch else cfg.deepspeed
    if batch and not problems:
        problems += dsc.check_keys(ds)  # now typed: DeepSpeed's models see real values
        problems += check_rules(cfg, ds, world)
    problems += named_input_problems(cfg)  # the files it names: show, lint and launch --dry-run report them too
    if problems:
        raise ConfigError(problems, source or cfg.name)
    train = dataclasses.replace(cfg.train, micro_batch_size=batch.micro_batch_size, grad_accum=batch.grad_accum,
                                global_batch_size=batch.global_batch_size)
    model = dataclasses.replace(cfg.model, tiled_logits=tiled_logits(cfg, batch, ds))
    data = dataclasses.replace(cfg.data, cross_document_attention=cross_document_attention(cfg.data))
    resolved = dataclasses.replace(cfg, model=model, data=data, train=train, deepspeed=ds)
    return Resolved(resolved, world, batch, adopted_notices(adopted, cfg) + notices(resolved, ds, world))


# The model.* fields a transformers config.json decides, by its key (the planner reads config.json the same way:
# trainer/plan/models.py). Qwen3-MoE names its experts num_experts, their width moe_intermediate_size (its
# intermediate_size is the width of dense MLP layers, which Qwen3-30B-A3B has none of), and its head_dim is free
ARCHITECTURE = {"hidden_size": "hidden_size", "num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
                "num_key_value_heads": "num_kv_heads", "intermediate_size": "intermediate_size",
                "vocab_size": "vocab_size", "max_position_embeddings": "max_position_embeddings",
                "tie_word_embeddings": "tie_word_embeddings", "num_local_experts": "num_experts",
                "num_experts_per_tok": "num_experts_per_tok", "rope_theta": "rope_theta"}
QWEN3_MOE_ARCHITECTURE = {"num_experts": "num_experts", "moe_intermediate_size": "intermediate_size",
                          "head_dim": "head_dim"}


@dataclass(frozen=True)
class Adopted:
    """A model.* value the pretrained model's config.json replaced: what the config said, what runs."""
    field: str
    said: object
    runs: object


def pretrained_architecture(cfg: Config) -> dict:
    """{model field: value} from the pretrained model's config.json when it is on disk ({} otherwise): the
    architecture that from_pretrained builds, whatever model.* says."""
    from .rules import pretrained_config
    saved = pretrained_config(cfg)
    if not saved:
        return {}
    fields = dict(ARCHITECTURE)
    if saved.get("model_type") == "qwen3_moe":
        fields.update(QWEN3_MOE_ARCHITECTURE)
    found = {ours: saved[theirs] for theirs, ours in fields.items() if theirs in saved}
    if "num_attention_heads" in saved and saved.get("num_key_value_heads") in (None, saved["num_attention_heads"]):
        found["num_kv_heads"] = None  # MHA: transformers' default, and model.num_kv_heads' None
    def well_typed(name: str, value) -> bool:  # a malformed config.json is from_pretrained's to refuse
        if value is None or name == "tie_word_embeddings":
            return value is None or isinstance(value, bool)
        number = (int, float) if name == "rope_theta" else int
        return isinstance(value, number) and not isinstance(value, bool) and value > 0
    found = {k: float(v) if k == "rope_theta" else v for k, v in found.items() if well_typed(k, v)}
    return {k: v for k, v in found.items() if hasattr(cfg.model, k)}


def adopt_pretrained_architecture(cfg: Config) -> tuple[Config, list[Adopted]]:
    """A pretrained model's architecture is its config.json's: model.* takes those values, so the resolved config
    (config.resolved.yaml, `show`, the planner's memory, every rule) describes the model that runs - not a preset's
    numbers that from_pretrained ignores (a 4-expert checkpoint recorded as 8). A `--set` that contradicts it is
    refused (options.resolved_with_overrides); a preset's values are replaced, and said."""
    runs = pretrained_architecture(cfg)
    adopted = [Adopted(k, getattr(cfg.model, k), v) for k, v in runs.items() if getattr(cfg.model, k) != v]
    if not adopted:
        return cfg, []
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **{a.field: a.runs for a in adopted})), adopted


def adopted_notices(adopted: list[Adopted], cfg: Config) -> list[str]:
    if not adopted:
        return []
    changes = ", ".join(f"model.{a.field} {a.said} -> {a.runs}" for a in adopted)
    return [f"{cfg.model.name_or_path}/config.json decides the pretrained model's architecture: {changes}"]


def cross_document_attention(data):
    """data.cross_document_attention, "auto" (None) decided: pretraining windows cut through the token stream and
    attend across it; packed SFT documents are separate conversations, each attending to itself. Where each sequence
    holds one document (preference pairs, unpacked SFT) there is nothing to decide and it stays None: a resolved
    config saved with a run is resolved again by evaluate and resume, and the rule refuses any value there."""
    if data.cross_document_attention is not None:
        return data.cross_document_attention
    if data.task == "pretrain":
        return True
    if data.task == "sft" and data.packing:
        return False
    return None


LONG_SEQUENCE_LOGITS = 1 << 30  # logits of one rank's share of a sequence from which tiling is on by default
LOGITS_TILE_BYTES = 1 << 30  # fp32 logits per tile: DeepSpeed ALST's slice size (1 GiB)


def tiled_logits(cfg: Config, batch: dsc.Batch, ds: dict) -> int:
    """model.tiled_logits, "auto" (None) decided. On for long sequences: one rank's share of a sequence
    (seq_len / sequence_parallel_size tokens) x vocab_size >= 2^30 logits, 4 GiB in fp32. The loss side holds three
    such tensors (logits, log-softmax, gradient: 12 GiB there), more than the checkpointed activations of a whole
    8B model; below it tiling only adds a launch per tile. Then one tile per GiB of the micro-batch's logits. Off
    where something else already avoids the whole logits (Liger's fused cross-entropy, where it runs), where they are not the
    model's own loss (preference tuning), and where tiling would be wrong (rules.tiled_logits_supported: fp16, tied
    embeddings)."""
    if cfg.model.tiled_logits is not None:
        return cfg.model.tiled_logits
    return auto_logits_tiles(cfg.model, cfg.data.seq_len, batch.sequence_parallel_size, batch.micro_batch_size,
                             dsc.precision(ds), cfg.data.task, dsc.zero_stage(ds))


def auto_logits_tiles(m, seq_len: int, sequence_parallel: int, micro_batch: int, precision: str,
                      task: str = "pretrain", zero_stage: int = 0) -> int:
    """`tiled_logits`' "auto" for model config `m` at these sizes (also asked by the rehearsal, would the preset
    tile?, and by the planner). Liger avoids the logits only where its fused loss runs (trainer.loss_path: not under
    ZeRO-3 or sequence parallelism), so only there does it keep the tiles off."""
    fused = fused_loss_possible(task, m.liger, zero_stage, sequence_parallel)
    if fused or m.tie_word_embeddings or task in ("preference", "grpo") or precision == "fp16":
        return 0
    per_sequence = seq_len // sequence_parallel * m.vocab_size
    if per_sequence < LONG_SEQUENCE_LOGITS:
        return 0
    return math.ceil(4 * per_sequence * micro_batch / LOGITS_TILE_BYTES)


def alst_mlp_tiles(hidden_size: int, seq_len: int, sequence_parallel: int, micro_batch: int) -> int:
    """ALST's model.tiled_mlp for one rank's share of a micro-batch: tiles of about hidden_size tokens (DeepSpeed's
    TiledMLP example, ceil(tokens / hidden)); 1 = nothing to tile. Suggested by lint, chosen by the planner."""
    tokens = seq_len // sequence_parallel * micro_batch
    return -(-tokens // hidden_size)


def even_tiles(rows: int, tiles: int) -> int:
    """The most tiles, up to `tiles`, that split `rows` evenly: torch.chunk gives fewer pieces than asked when they
    do not (6 rows in 4 -> 3 of 2), and TiledFusedLogitsLoss marks the head's gradient ready at piece number `tiles`,
    which must exist. What the tiled loss runs (train.sequence_parallel) and the planner counts."""
    return max(t for t in range(1, min(tiles, rows) + 1) if rows % t == 0)


def _canonical_gpu_name(cfg: Config) -> Config:
    """hardware.gpu as the planner reads it: case does not matter (`A100-80G` is `a100-80g`), and an alias is its
    accelerator's name (`h100` is `h100-80g`: trainer/accelerators.yaml)."""
    name = cfg.hardware.gpu
    canonical = canonical_name(name) if isinstance(name, str) else None
    if canonical and canonical != name:
        return dataclasses.replace(cfg, hardware=dataclasses.replace(cfg.hardware, gpu=canonical))
    return cfg


def check_values(cfg: Config) -> list[str]:
    """Impossible combinations in the trainer's own sections (types, and each number's own range, were checked
    when the preset was read: trainer/numbers.py kinds in the schema)."""
    m, d, t, h = cfg.model, cfg.data, cfg.train, cfg.hardware
    checks = [
        (h.gpu in GPUS, f"hardware.gpu: unknown GPU type {h.gpu!r}{unknown_hint(str(h.gpu))}; "
                        f"known: {', '.join(GPUS)} (or add an entry to trainer/{TABLE.name})"),
        (m.num_heads <= 0 or m.hidden_size % m.num_heads == 0,
         f"model.hidden_size={m.hidden_size} must be divisible by model.num_heads={m.num_heads}"),
        (m.num_kv_heads is None or (m.num_kv_heads > 0 and m.num_heads % m.num_kv_heads == 0),
         f"model.num_heads={m.num_heads} must be divisible by model.num_kv_heads={m.num_kv_heads}"),
        (d.seq_len <= m.max_position_embeddings,
         f"data.seq_len={d.seq_len} exceeds model.max_position_embeddings={m.max_position_embeddings}"),
        (0 <= d.eval_fraction < 1 and (d.eval_fraction > 0 or d.eval_source),
         f"data.eval_fraction={d.eval_fraction} must be in (0, 1) (or in [0, 1) with data.eval_source set): "
         f"the loop evaluates every train.eval_every steps"),
        (bool(d.source) != bool(d.sources), "data.source and data.sources: give exactly one (a prepared directory, "
         "a local file/directory or a hub dataset name; or a list of them with weights)"),
        (all(s.path for s in d.sources), "data.sources: every entry needs a path"),
        (not d.sources or sum(s.weight for s in d.sources if math.isfinite(s.weight) and s.weight > 0) > 0,
         f"data.sources: weights {[s.weight for s in d.sources]} must sum to more than 0"),
        (0 <= t.min_lr <= t.lr, f"train.min_lr={t.min_lr} must be in [0, train.lr]"),
        (0 <= t.warmup_steps <= t.max_steps, f"train.warmup_steps={t.warmup_steps} must be in [0, max_steps]"),
        (bool(t.output_dir), "train.output_dir is empty"),
        (not (m.lora.enabled and m.name_or_path is None),
         "model.lora.enabled needs pretrained weights: set model.name_or_path (LoRA on a random model learns nothing)"),
    ]
    problems = strict.out_of_range(cfg) + [message for ok, message in checks if not ok]
    problems += same_source_names(d.sources)
    problems += control_character_problems(cfg)
    problems += [message for key, value in _one_line_strings(cfg, every=True)  # sample prompts, chat template, ...
                 if (message := text.refusal(value, "the config", key))]       # the one text gate
    if h.gpu in GPUS and t.precision == "bf16" and not GPUS[h.gpu].bf16:  # before the DeepSpeed bf16 block's view
        problems.append(f"train.precision=bf16: bf16 is enabled but {GPUS[h.gpu].description} (hardware.gpu={h.gpu}) "
                        f"has no bf16; use "
                        f"train.precision=fp16 with an fp16 block (dynamic loss scaling), as in preset 7b_2xv100")
    for key in ("micro_batch_size", "grad_accum", "global_batch_size"):
        value = getattr(t, key)
        if isinstance(value, str) and value != AUTO:
            problems.append(f"train.{key}: {value!r} must be a positive integer or 'auto'")
    return problems


def same_source_names(sources) -> list[str]:
    """Every source's name distinct: eval metrics (eval_loss/<name>), the data stats and the cached reference
    log-probs of preference runs are keyed by it, so two sources of one name would silently share one entry."""
    first: dict[str, int] = {}
    problems = []
    for i, source in enumerate(sources):
        name = source.shown_name()
        if source.name is not None and (not name.strip() or "/" in name or "\\" in name or name in (".", "..")):
            problems.append(f"data.sources[{i}].name: {name!r} names files of the cache and metric keys: use a "
                            f"plain name without slashes (e.g. 'web')")
            continue
        if name in first:
            how = "" if source.name else " (taken from its path: no name: set)"
            problems.append(f"data.sources[{i}].name: {name!r}{how} is also data.sources[{first[name]}]'s name; eval "
                            f"metrics, data stats and cached files are keyed by it: give each source its own name:")
        first.setdefault(name, i)
    return problems


def control_character_problems(cfg: Config) -> list[str]:
    """Every one-line string of the config (names, paths, the DeepSpeed section's strings) free of control
    characters: they reach sbatch directives, shell scripts, log lines and file names, where a newline starts
    a new line (a new command) and a tab or escape changes what is shown."""
    return [f"{key}: {short(value)} holds {control_characters(value)}: names and paths are written into launch "
            f"scripts, log lines and file names, where it would start a new line or command; remove it"
            for key, value in _one_line_strings(cfg) if CONTROL.search(value)]


def _one_line_strings(node, key: str = "", every: bool = False):
    """(dotted key, string) for every string under `node` except those of `multiline` fields (`every`: those too)."""
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            if every or not f.metadata.get("multiline"):
                yield from _one_line_strings(getattr(node, f.name), f"{key}.{f.name}" if key else f.name, every)
    elif isinstance(node, dict):
        for name, value in node.items():
            yield from _one_line_strings(value, f"{key}.{name}" if key else str(name), every)
    elif isinstance(node, (list, tuple)):
        for index, value in enumerate(node):
            yield from _one_line_strings(value, f"{key}[{index}]", every)
    elif isinstance(node, str):
        yield key, node
