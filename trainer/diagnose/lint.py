"""`python -m trainer lint PRESET`: check a resolved config against the seed's tuning checklist (step 6).

Each check reads the resolved config (DeepSpeed keys only through `trainer.ds`) and returns
findings with a severity: `error` (it will not run or will not fit), `warn` (a high/medium-priority
checklist item is off) or `info` (advice, and low-priority items). Lint never changes the config;
the exit status is 1 when there is an error, else 0.

| # | checklist item (seed step 6)              | check here                                                  |
|---|-------------------------------------------|-------------------------------------------------------------|
| 1 | mixed precision                           | fp32 on a GPU; fp16 where bf16 exists                       |
| 2 | lowest ZeRO stage that fits               | planner estimate vs GPU budget; stage 0/1; stage 3 when 2 fits |
| 3 | largest micro-batch                       | planner: a larger micro-batch that still fits               |
| 4 | overlap_comm                              | off with more than one GPU                                  |
| 5 | gradient accumulation vs communication    | what accumulation saves at this stage                       |
| 6 | activation checkpointing                  | long sequences without it; on when not needed               |
| 7 | --bind_cores_to_rank with CPU offload     | advice (the launch line is not in the config)               |
| 8 | pin_memory with offload                   | off                                                         |
| 9 | ZeRO++ on several nodes                   | no hpZ at stage 3; hpZ size != GPUs per node; stage < 3     |
| 11| pipelined NVMe I/O                        | pipeline_read/write off                                     |
| - | bucket sizes                              | outside the useful range; their memory                      |
| - | contiguous gradients                      | off                                                         |
| - | chat template                             | SFT, data.chat_template unset, tokenizer not known to have one |
| - | MoE layout                                | experts of a model the trainer cannot find blocks of; EP across nodes; no EP at stage 3 |
| - | sequence parallel                         | a group across nodes; long shares without tiled MLPs (heads, eager, seq_len: resolve errors) |
| - | GRPO                                      | groups of fewer than 4 completions; a rollout that sets the memory peak; several iterations without clipping room |
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from dataclasses import asdict, dataclass
from typing import Callable, Optional

from .. import ds as dsc
from .. import hardware
from ..options import add_preset_arguments, load_and_resolve
from ..plan import memory as mem
from ..plan.estimate import COSTS, MAX_MICRO_BATCH, MEMORY_HEADROOM, TIGHT, Candidate, gb, memory_report, plan_for_resolved, stage_below_two_wasted
from ..presets import ACCEPTED_WARNING, accepted_warnings, preset_path
from ..resolve import Resolved, alst_mlp_tiles


SEVERITIES = ("error", "warn", "info")
LONG_SEQUENCE = 8192            # seed step 6 #6: "long sequences: checkpointing is a must"
USEFUL_BUCKET = dsc.USEFUL_BUCKET  # elements: the planner sizes a small model's 'auto' buckets into it


@dataclass(frozen=True)
class Finding:
    severity: str
    check: str
    message: str
    accepted: str = ""  # a warning the preset's header names as an accepted trade-off: its reason, from the header


Check = Callable[[Resolved], list[Finding]]


def on_gpus(r: Resolved) -> bool:
    return r.config.hardware.gpu != "cpu"


def mixed_precision(r: Resolved) -> list[Finding]:
    gpu, name = hardware.gpu(r.config.hardware.gpu), dsc.precision(r.ds)
    if not on_gpus(r):
        return []
    if name == "fp32":
        want = "bf16" if gpu.bf16 else "fp16 with dynamic loss scaling"
        return [Finding("warn", "#1 mixed precision", f"training in fp32 on {gpu.description}: {want} halves "
                        f"activation memory and runs on tensor cores (--set train.precision=...)")]
    if name == "fp16" and gpu.bf16:
        return [Finding("warn", "#1 mixed precision", f"fp16 on {gpu.description}, which has bf16: bf16 needs no "
                        f"loss scaling and does not overflow (seed step 3.2)")]
    return []


def planner_line(est) -> str:
    """The planner's estimate as lint prints it: the numbers of `memory_report`, which `show` lists too."""
    n = memory_report(est)
    parts = ", ".join(f"{name.replace('_', ' ')} {n[name]:.1f}" for name in ("params", "grads", "optimizer", "activations", "buffers",
                                                          "reference_model") if name in n)
    return (f"planner: {n['per_gpu']:.1f} GB per GPU of {n['usable']:.1f} usable ({parts}); host "
            f"{n['host_per_node']:.1f} GB per node"
            + (f"; the one-time reference log-prob pass peaks at {n['reference_pass_peak']:.1f} GB per GPU"
               if "reference_pass_peak" in n else ""))


def zero_stage_fits(r: Resolved) -> list[Finding]:
    est, stage = plan_for_resolved(r), dsc.zero_stage(r.ds)
    out = []
    if on_gpus(r):
        verdict = planner_line(est)
        if not est.fits_gpu:
            out.append(Finding("error", "#2 ZeRO stage", f"will not fit: {verdict}; `python -m trainer plan "
                               f"--model {r.config.name} ...` finds one that does"))
        elif not est.fits_cpu:
            out.append(Finding("error", "#2 ZeRO stage", f"host RAM will not hold the offloaded states: {verdict}"))
        else:
            out.append(Finding("info", "#2 ZeRO stage", verdict))
        if est.tight:  # the rule the planner's micro-batch reads (estimate.TIGHT), so lint never warns about a plan
            out.append(Finding("warn", MEMORY_HEADROOM, f"{gb(est.peak)} GB per GPU is "
                               f"{est.peak / est.gpu_budget:.0%} of the {gb(est.gpu_budget)} GB usable (past "
                               f"{TIGHT:.0%}): a longer batch, allocator fragmentation or NCCL's buffers can run out "
                               f"of memory; a smaller train.micro_batch_size with more train.grad_accum keeps the "
                               f"global batch"))
    if stage_below_two_wasted(stage, r.batch.data_parallel_size):  # the rule the planner's walk reads
        out.append(Finding("info", "#2 ZeRO stage", f"stage {stage} on {r.batch.data_parallel_size} data-parallel "
                           f"ranks: stage 2 has the same communication volume and shards gradients too (seed step "
                           f"1.2)"))
    if on_gpus(r) and stage == 3 and dsc.offload_optimizer_device(r.ds) == "none":
        two = plan_for_resolved(r, candidate=Candidate("zero2", 2))
        if two.roomy:
            out.append(Finding("info", "#2 ZeRO stage", f"{COSTS['stage 3']}, and stage 2 fits here "
                               f"({gb(two.gpu_total)} GB per GPU)"))
    return out


def micro_batch_size(r: Resolved) -> list[Finding]:
    if not on_gpus(r):
        return []
    est = plan_for_resolved(r)
    if not est.fits:
        return []
    micro = r.batch.micro_batch_size
    bigger = max((m for m in (micro * 2, micro * 4, micro * 8)  # the planner's options: roomy, within its cap
                  if m <= MAX_MICRO_BATCH and plan_for_resolved(r, micro_batch=m).roomy), default=micro)
    if bigger > micro:
        return [Finding("info", "#3 micro-batch", f"micro-batch {micro}: the planner fits {bigger} "
                        f"(fewer accumulation steps, better GPU utilisation); keep the global batch with "
                        f"train.grad_accum")]
    return []


def overlap_comm(r: Resolved) -> list[Finding]:
    if r.world_size > 1 and dsc.zero_stage(r.ds) > 0 and not dsc.overlap_comm(r.ds):
        return [Finding("warn", "#4 overlap_comm", f"overlap_comm is off with {r.world_size} ranks: gradient "
                        f"reduction waits for backward to finish (DeepSpeed defaults it on only at stage 3); "
                        f"set deepspeed.zero_optimization.overlap_comm=true")]
    return []


def grad_accumulation(r: Resolved) -> list[Finding]:
    stage, accum = dsc.zero_stage(r.ds), r.batch.grad_accum
    if r.world_size == 1:
        return []
    if stage >= 2 and accum > 1:
        return [Finding("info", "#5 gradient accumulation", f"ZeRO-{stage} reduce-scatters gradients on every "
                        f"micro-step (each rank keeps only its partition), so grad_accum {accum} does not cut "
                        f"its communication; a larger micro-batch does. Stages 0/1 reduce once per step")]
    if stage <= 1 and accum == 1:
        return [Finding("info", "#5 gradient accumulation", f"stage {stage} all-reduces once per optimizer step: "
                        f"gradient accumulation divides that communication by the number of micro-steps")]
    return []


def activation_checkpointing(r: Resolved) -> list[Finding]:
    on, seq = r.config.model.gradient_checkpointing, r.config.data.seq_len
    if not on and seq >= LONG_SEQUENCE and not (on_gpus(r) and plan_for_resolved(r).roomy):  # as the planner
        return [Finding("warn", "#6 activation checkpointing", f"seq_len {seq} without activation checkpointing: "
                        f"activations grow with sequence length (seed: a must for long sequences); "
                        f"set model.gradient_checkpointing=true unless the planner shows it fits")]
    if on and on_gpus(r):
        without = plan_for_resolved(r, checkpointing=False)
        if without.roomy:
            return [Finding("info", "#6 activation checkpointing", f"{COSTS['checkpointing']}, but this "
                            f"micro-batch fits without it ({gb(without.gpu_total)} GB per GPU)")]
    return []


def bind_cores(r: Resolved) -> list[Finding]:
    if "cpu" in (dsc.offload_optimizer_device(r.ds), dsc.offload_param_device(r.ds)):
        return [Finding("info", "#7 --bind_cores_to_rank", "CPU offload: launch with `deepspeed --bind_cores_to_rank "
                        "...` so each rank's CPU Adam gets its own cores (and check cores and memory bandwidth "
                        f"per rank): {COSTS['offload']}")]
    return []


def pin_memory(r: Resolved) -> list[Finding]:
    out = []
    for which in ("offload_optimizer", "offload_param"):
        device = dsc.offload_optimizer_device(r.ds) if which == "offload_optimizer" else dsc.offload_param_device(r.ds)
        if device != "none" and not dsc.offload_pin_memory(r.ds, which):
            out.append(Finding("warn", "#8 pin_memory", f"{which} to {device} without pin_memory: pageable host "
                               f"memory halves CPU<->GPU copy speed; set zero_optimization.{which}.pin_memory=true"))
    return out


def zeropp_multi_node(r: Resolved) -> list[Finding]:
    hw, stage, hpz = r.config.hardware, dsc.zero_stage(r.ds), dsc.hpz_partition_size(r.ds)
    if hw.nodes <= 1:
        return []
    if stage < 3:
        return [Finding("info", "#9 ZeRO++", f"{hw.nodes} nodes at stage {stage}: ZeRO++ (hpZ, quantized "
                        f"weights/gradients) only works at stage 3 in DeepSpeed 0.19.8; if cross-node "
                        f"bandwidth limits you, stage 3 + ZeRO++ is the lever")]
    if hpz <= 1:
        return [Finding("warn", "#9 ZeRO++", f"{hw.nodes} nodes at stage 3 without hpZ: every parameter "
                        f"all-gather crosses nodes; set zero_optimization.zero_hpz_partition_size="
                        f"{hw.gpus_per_node} (and zero_quantized_gradients: true) - costs 2P/{hw.gpus_per_node} "
                        f"bytes per GPU")]
    out = []
    if hpz != hw.gpus_per_node:
        out.append(Finding("info", "#9 ZeRO++", f"zero_hpz_partition_size {hpz} != GPUs per node "
                           f"{hw.gpus_per_node}: the secondary partition should span exactly one node"))
    if not dsc.quantized_gradients(r.ds):
        out.append(Finding("info", "#9 ZeRO++", "zero_quantized_gradients is off: cross-node gradient "
                           "reduce-scatter moves full 16-bit gradients"))
    return out


def nvme_pipeline(r: Resolved) -> list[Finding]:
    if dsc.offload_optimizer_device(r.ds) == "nvme" and not dsc.nvme_pipelined(r.ds):
        return [Finding("info", "#11 NVMe pipeline", "optimizer NVMe offload without pipeline_read and "
                        "pipeline_write: swaps do not overlap the optimizer step; set both true")]
    return []


def bucket_sizes(r: Resolved) -> list[Finding]:
    if not on_gpus(r) or r.world_size == 1:
        return []  # CPU rehearsals size buckets for toy models; one GPU communicates nothing
    stage, out = dsc.zero_stage(r.ds), []
    names = ["reduce_bucket_size"] + (["allgather_bucket_size"] if stage in (1, 2) else [])
    names += ["prefetch_bucket_size"] if stage == 3 else []
    low, high = USEFUL_BUCKET
    for name in names:
        value = int(dsc.zero_setting(r.ds, name))
        if value < low:
            out.append(Finding("warn", "bucket sizes", f"{name}={value:.2g} elements: many small collectives "
                               f"(useful range {low:.0e}-{high:.0e}; the seed suggests 5e7-5e8)"))
        elif value > high:
            out.append(Finding("warn", "bucket sizes", f"{name}={value:.2g} elements: communication starts late "
                               f"and the buffers cost GBs (useful range {low:.0e}-{high:.0e})"))
    if stage in (1, 2):
        cost = mem.reduce_bucket_bytes(stage, int(dsc.zero_setting(r.ds, "reduce_bucket_size")), dsc.precision(r.ds),
                                       dsc.overlap_comm(r.ds))
        if cost >= 1e9:
            out.append(Finding("info", "bucket sizes", f"reduce buckets hold {gb(cost)} GB per GPU; smaller buckets "
                               f"free that memory for activations"))
    return out


def contiguous_gradients(r: Resolved) -> list[Finding]:
    if dsc.zero_stage(r.ds) > 0 and not dsc.contiguous_gradients(r.ds):
        return [Finding("warn", "contiguous gradients", "contiguous_gradients is off: gradients fragment memory "
                        "and overlap_comm needs them contiguous; set zero_optimization.contiguous_gradients=true")]
    return []


def chat_template(r: Resolved) -> list[Finding]:
    data, model = r.config.data, r.config.model
    if data.task != "sft" or data.chat_template is not None:
        return []
    # Imported here: the data pipeline imports datasets (seconds), which no other check needs.
    from ..data.tokenize import TEMPLATE_CHOICES, has_chat_template_on_disk
    tokenizer = model.tokenizer or model.name_or_path
    if has_chat_template_on_disk(tokenizer):
        return []
    return [Finding("warn", "chat template", f"SFT with data.chat_template unset on tokenizer {tokenizer!r}, not a "
                    f"local directory with a chat template: the tokenizer may lack a chat template (base "
                    f"checkpoints ship none), and chat messages records then stop at data preparation; set "
                    f"data.chat_template: {TEMPLATE_CHOICES} (prompt/response records need none)")]


EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")  # config.json names


def moe_leaf_risk(r: Resolved) -> Optional[tuple[str, list[str]]]:
    """An MoE under ZeRO-3 whose expert blocks are not ZeRO-3 leaf modules: ranks that route tokens to different
    experts gather different parameters and hang. (what to say, the overrides that fix it), or None. One entry for
    lint (a warning before the run) and the doctor (the cause of a hang or of ranks out of step)."""
    from ..moe import MOE_FAMILIES
    from ..rules import pretrained_config
    m, stage = r.config.model, dsc.zero_stage(r.ds)
    saved = pretrained_config(r.config)
    model_type = saved.get("model_type", m.family)
    experts = next((saved[k] for k in EXPERT_FIELDS if saved.get(k)), None) or m.num_experts
    if not experts or stage != 3 or m.zero3_leaf_modules:
        return None
    if m.zero3_leaf_modules == [] and model_type in MOE_FAMILIES:
        return (f"{m.name_or_path or m.family} is an MoE ({experts} experts) at ZeRO-3 with model.zero3_leaf_modules=[] "
                f"(no leaf modules): ranks that route tokens to different experts gather different parameters and "
                f"hang; leave it unset (null) and the trainer makes its {model_type} MoE blocks leaf modules",
                ["model.zero3_leaf_modules=null"])
    if model_type in MOE_FAMILIES:
        return None
    return (f"{m.name_or_path} is an MoE ({experts} experts, model_type {model_type!r}) of a family whose MoE blocks "
            f"the trainer does not find on its own: under ZeRO-3, ranks that route tokens to different experts can "
            f"gather different parameters and hang; set model.zero3_leaf_modules to its MoE block class (e.g. "
            f"[{model_type.title()}SparseMoeBlock]; a wrong name is an error before any step)", [])


def moe_layout(r: Resolved) -> list[Finding]:
    """MoE mistakes the rules cannot call errors: an MoE at ZeRO-3 whose blocks are not leaf modules
    (moe_leaf_risk); AutoEP groups wider than a node; a known MoE family at stage 3 on several GPUs without AutoEP."""
    from ..moe import MOE_FAMILIES
    from ..rules import pretrained_config
    m, stage, ep = r.config.model, dsc.zero_stage(r.ds), dsc.autoep_size(r.ds)
    saved = pretrained_config(r.config)
    model_type = saved.get("model_type", m.family)
    experts = next((saved[k] for k in EXPERT_FIELDS if saved.get(k)), None) or m.num_experts
    risk = moe_leaf_risk(r)
    out = [Finding("warn", "MoE layout", risk[0])] if risk else []
    if ep > r.config.hardware.gpus_per_node and r.config.hardware.nodes > 1:
        out.append(Finding("warn", "MoE layout", f"expert_parallel.autoep_size={ep} spans more than the "
                           f"{r.config.hardware.gpus_per_node} GPUs of a node: every MoE layer's two all-to-alls cross "
                           f"the network; use autoep_size <= {r.config.hardware.gpus_per_node}"))
    if (experts and model_type in MOE_FAMILIES and stage == 3 and ep == 1 and r.world_size > 1 and on_gpus(r)
            and not m.lora.enabled and experts % r.config.hardware.gpus_per_node == 0):
        size = r.config.hardware.gpus_per_node
        out.append(Finding("info", "MoE layout", f"ZeRO-3 gathers all {experts} experts of each layer into every GPU; "
                           f"DeepSpeed AutoEP (deepspeed.expert_parallel={{enabled: true, autoep_size: {size}}}) keeps "
                           f"{experts // size} per GPU and sends tokens to them instead (python -m trainer plan "
                           f"--expert-parallel {size} shows the memory and the all-to-all volume)"))
    return out


def sequence_parallel(r: Resolved) -> list[Finding]:
    """What resolve cannot refuse about a Ulysses group (heads, eager attention and seq_len it does refuse, before
    lint runs): where its all-to-alls travel, and whether the MLP still holds a rank's whole share of a sequence."""
    sp, hw, m = dsc.sequence_parallel_size(r.ds), r.config.hardware, r.config.model
    if sp == 1:
        return []
    out = []
    if on_gpus(r) and sp > hw.gpus_per_node:
        out.append(Finding("warn", "sequence parallel", f"sequence_parallel_size={sp} > {hw.gpus_per_node} GPUs per "
                           f"node: a group spans nodes, and Ulysses' four all-to-alls per layer cross the network; "
                           f"keep a group inside a node (a size dividing {hw.gpus_per_node})"))
    tokens = r.config.data.seq_len // sp * r.batch.micro_batch_size
    tiles = alst_mlp_tiles(m.hidden_size, r.config.data.seq_len, sp, r.batch.micro_batch_size)
    from ..moe import MOE_FAMILIES
    from ..rules import model_type
    dense = model_type(r.config) not in MOE_FAMILIES  # an MoE's experts are not tiled (rules.tiled_mlp_has_dense_mlps)
    if m.tiled_mlp == 0 and tiles >= 2 and r.config.data.seq_len >= LONG_SEQUENCE and dense:
        out.append(Finding("info", "sequence parallel", f"each rank runs its MLPs over {tokens} tokens at once "
                           f"(4 x intermediate_size activations each); model.tiled_mlp={tiles} (DeepSpeed's "
                           f"TiledMLP, tiles of ~hidden_size tokens) keeps one tile's"))
    return out


def grpo(r: Resolved) -> list[Finding]:
    """GRPO's own settings (docs/rl.md): group size, the rollout's memory, the clip range with several iterations."""
    cfg = r.config
    if cfg.data.task != "grpo":
        return []
    g, out = cfg.grpo, []
    if g.num_generations < 4:
        out.append(Finding("warn", "GRPO", f"grpo.num_generations={g.num_generations}: with fewer than 4 completions "
                           f"per prompt the group's mean and std are poor baselines, and a group whose rewards are all "
                           f"equal teaches nothing (its advantages are 0); published recipes use 8 or 16"))
    if g.num_iterations > 1 and g.epsilon == 0:
        out.append(Finding("warn", "GRPO", f"grpo.num_iterations={g.num_iterations} with grpo.epsilon=0: every "
                           f"later pass over a rollout is clipped away; give the ratio room (0.2)"))
    if cfg.hardware.gpu != "cpu":
        estimate = plan_for_resolved(r)
        if estimate.rollout_sets_peak:
            out.append(Finding("info", "GRPO", f"the rollout, not training, sets the memory peak: {gb(estimate.rollout)} "
                               f"GB per GPU while generating ({gb(estimate.gpu_total)} GB while training); a smaller "
                               f"train.micro_batch_size (the rollout batch) or grpo.max_new_tokens lowers it"))
    return out


CHECKS: list[Check] = [mixed_precision, zero_stage_fits, micro_batch_size, overlap_comm, grad_accumulation,
                       activation_checkpointing, bind_cores, pin_memory, zeropp_multi_node, nvme_pipeline,
                       bucket_sizes, contiguous_gradients, chat_template, moe_layout,
                       sequence_parallel, grpo]


def lint_resolved(r: Resolved, accepted: Optional[dict[str, str]] = None) -> list[Finding]:
    """Every check's findings, errors first. `accepted`: check -> reason, the warnings the preset's header names as
    accepted trade-offs (presets.accepted_warnings): still reported, marked accepted; an accepted check that no
    longer warns is a note, so a stale header line is seen."""
    accepted = accepted or {}
    findings = [dataclasses.replace(f, accepted=accepted[f.check]) if f.severity == "warn" and f.check in accepted
                else f for check in CHECKS for f in check(r)]
    warned = {f.check for f in findings if f.severity == "warn"}
    findings += [Finding("info", check, f"the preset's header accepts a [{check}] warning that lint no longer "
                         f"raises: remove its `# {ACCEPTED_WARNING} [{check}]: ...` line") for check in accepted
                 if check not in warned]
    return sorted(findings, key=lambda f: SEVERITIES.index(f.severity))


def lint_preset(name_or_path: str, resolved: Resolved) -> list[Finding]:
    """lint_resolved with the warnings the preset file's header accepts."""
    return lint_resolved(resolved, accepted_warnings(preset_path(name_or_path)))


def lint_arguments(parser: argparse.ArgumentParser) -> None:
    add_preset_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the findings as a JSON list")


def lint(args) -> int:
    resolved = load_and_resolve(args)
    with contextlib.redirect_stdout(sys.stderr):
        findings = lint_preset(args.preset, resolved)
    if args.json:
        print(json.dumps([asdict(f) for f in findings], indent=2))
    else:
        counts = {s: sum(f.severity == s for f in findings) for s in SEVERITIES}
        accepted = sum(bool(f.accepted) for f in findings)
        print(f"lint {resolved.config.name} (world size {resolved.world_size}, ZeRO-{dsc.zero_stage(resolved.ds)}): "
              f"{counts['error']} error(s), {counts['warn']} warning(s)"
              + (f" ({accepted} accepted in the preset's header)" if accepted else "")
              + f", {counts['info']} note(s)")
        for f in findings:
            print(f"{f.severity.upper():<5} [{f.check}] {f.message}"
                  + (f" -- accepted in the preset's header: {f.accepted}" if f.accepted else ""))
    return 1 if any(f.severity == "error" for f in findings) else 0
