"""Checkpoints and ZeRO-3 weights: a checkpoint resumed on another topology, 16-bit weights not gathered at
save time, a full state dict loaded into a partitioned model, and ZeRO-3 combined with loading options that
place the weights themselves (`device_map`, `low_cpu_mem_usage`, 8/4-bit loading)."""
from __future__ import annotations

import re

from ... import ds as dsc
from ...plan.estimate import gb
from .. import installed
from ..findings import Diagnosis, Found, Proposal, planned
from ..raised import final_exception

# --- ZeRO-3 weights: saving and loading ----------------------------------------------------------------------


# a saved model's parameters listed with zero size ("model.embed_tokens.weight : torch.Size([0])",
# "'lm_head.weight': torch.Size([0])"): ZeRO-3's placeholders were written instead of the consolidated weights
SAVED_EMPTY = re.compile(r"[\w.]+\.(?:weight|bias)['\"]?\s*[:=,]\s*(?:shape\s*)?torch\.Size\(\[0\]\)")
CONSOLIDATE = ("under ZeRO-3 each rank holds a shard and a model saved without gathering holds the empty "
               "placeholders (torch.Size([0])); the shards in the DeepSpeed checkpoint hold the trained weights: "
               "consolidate them with `python -m deepspeed.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR` (the "
               "checkpoint's zero_to_fp32.py; OUTPUT_DIR is a folder) - this trainer's `python -m trainer export` "
               "does it for its own runs")


def diagnose_save(f: Found) -> Diagnosis:
    r = f.resolved
    d = Diagnosis("stage3_save", "ZeRO-3 saved incomplete (sharded or empty) weights", f.line)
    if f.log.has(SAVED_EMPTY) and not f.log.has(re.compile(r"copying a param with shape")):
        d.proposal = Proposal("consolidate the ZeRO-3 shards into whole weights: zero_to_fp32", [], CONSOLIDATE)
        if dsc.zero_stage(r.ds) == 3 and not dsc.gather_16bit_on_save(r.ds):
            d.then.append(Proposal("and gather 16-bit weights on save from now on", [dsc.gather_on_save_override(r.ds)],
                                   "DeepSpeed writes a whole 16-bit model only when told to gather it at save time"))
        return d
    if dsc.zero_stage(r.ds) == 3 and not dsc.gather_16bit_on_save(r.ds):
        d.proposal = Proposal("gather 16-bit weights on save", [dsc.gather_on_save_override(r.ds)],
                              "under ZeRO-3 each rank holds a shard; DeepSpeed only writes a whole 16-bit model "
                              "when told to gather it at save time (seed step 7.2)")
    elif "stage3_gather_16bit_weights_on_model_save" in f.log.text:
        d.advice.append(f"this log did not come from preset {r.config.name} as configured: it " + (
            "already gathers 16-bit weights on save" if dsc.zero_stage(r.ds) == 3 else "is not ZeRO-3"))
    d.advice.append("weights already trained are in the DeepSpeed checkpoint: rebuild them with "
                    "`python -m deepspeed.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR` (OUTPUT_DIR is a folder)")
    return d


def diagnose_zero3_load(f: Found) -> Diagnosis:
    r = f.resolved
    d = Diagnosis("zero3_load", "a full state dict was loaded into a ZeRO-3 partitioned model (its parameters are "
                                "torch.Size([0]) placeholders)", f.line)
    own = "" if r.config.model.name_or_path else " (set model.name_or_path to the weights' directory or hub id)"
    framework = _loading_framework(f)
    stage_2 = _stage_2_fits(f) if framework else None
    if stage_2 is not None:  # the loading is the framework's, not the user's to restructure: leave ZeRO-3 if it fits
        overrides, priced = stage_2
        d.proposal = Proposal(f"train at ZeRO stage 2 (zero2): {framework} loaded the full weights into ZeRO-3's "
                              f"partitioned placeholders", overrides,
                              f"the loading code is {framework}'s, so zero.Init cannot be put around it from the "
                              f"command line; at stage 2 every rank holds whole parameters - {priced}",
                              estimate=priced)
        d.then.append(Proposal(f"to stay at ZeRO-3: a {framework} release (or config) that loads under "
                               "deepspeed.zero.Init", [], "its ZeRO-3 path builds the model partitioned first"))
        return d
    d.proposal = Proposal("load the weights while the model is built (from_pretrained under deepspeed.zero.Init)", [],
                          "under ZeRO-3 each rank holds only a partition, so load_state_dict into the engine (or "
                          "into a model created under the stage-3 strategy) sees empty parameters. Let the loader "
                          f"gather each partition: this trainer loads model.name_or_path under deepspeed.zero.Init"
                          f"{own}; in your own script create HfDeepSpeedConfig(ds_config) (or the TrainingArguments "
                          "with deepspeed=...) before from_pretrained, or copy weights inside "
                          "`deepspeed.zero.GatheredParameters(params, modifier_rank=0)`")
    d.advice.append("to read a trained ZeRO-3 checkpoint outside DeepSpeed, convert it first: `python -m "
                    "deepspeed.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR` and load that into an unpartitioned model")
    return d


FRAMEWORKS = ("axolotl", "llamafactory", "llmtuner", "trl", "swift", "unsloth")


def _loading_framework(f: Found) -> str:
    """The fine-tuning framework whose code did the loading, from the traceback's frames ('' for the user's own)."""
    raised = final_exception(f.log)
    frames = list(raised.frames) if raised else f.log.frames(f.index)
    paths = " ".join(fr.file.lower() for fr in frames) or "\n".join(f.log.lines[:40]).lower()
    return next((name for name in FRAMEWORKS if f"/{name}/" in paths or f"{name}/cli" in paths), "")


def _stage_2_fits(f: Found):
    """([the override], its price) when ZeRO-2 resolves for the preset and the planner fits it; None otherwise."""
    overrides = ["deepspeed.zero_optimization.stage=2"]
    resolved = f.resolves(overrides)
    plan = planned(resolved)
    if plan is None or plan.gpu_total > plan.gpu_budget:
        return None
    return overrides, f"{gb(plan.gpu_total)} of {gb(plan.gpu_budget)} GB per GPU at stage 2 (planner)"


# --- a checkpoint resumed on another topology -------------------------------------------------------------------

TOPOLOGY = re.compile(r"(The checkpoint being loaded used a DP world size of (\d+) but the current world size is (\d+)|"
                      r"Automatic adjustment of ZeRO's optimizer state partitioning with a new world size|"
                      r"No such file or directory: '[^']*zero_pp_rank_\d+_mp_rank_\d+_optim_states\.pt')")


def diagnose_topology(f: Found) -> Diagnosis:
    sizes = next((m for m in f.log.all(TOPOLOGY) if m.group(2)), None)
    change = f" ({sizes.group(2)} -> {sizes.group(3)} data-parallel ranks)" if sizes else ""
    d = Diagnosis("ckpt_topology", f"a ZeRO checkpoint resumed on another data-parallel size{change}", f.line)
    d.proposal = Proposal("resume through the universal checkpoint: this trainer's elastic resume (--resume auto)", [],
                          "ZeRO partitions the optimizer states by data-parallel rank, so DeepSpeed's own files load "
                          "only on the layout that saved them. This trainer's resume converts such a checkpoint once "
                          "with DeepSpeed's ds_to_universal (into step_N/universal/) and loads it on the new world "
                          "size, keeping the global batch", train_args=("--resume", "auto"))
    d.advice += [
        "outside this trainer: `python -m deepspeed.checkpoint.ds_to_universal --input_folder CKPT/global_stepN "
        "--output_folder CKPT/global_stepN_universal`, then load with `\"checkpoint\": {\"load_universal\": true}` "
        "in the DeepSpeed config (or go back to the world size that saved it)",
        "weights only (a new run, fresh optimizer): `python -m deepspeed.utils.zero_to_fp32 CKPT OUTPUT_DIR`",
    ]
    return d


# --- ZeRO-3 with loaders that place the weights themselves ------------------------------------------------------

DEVICE_MAP = re.compile(r"(Zero-?3 is not compatible with .{0,3}low_cpu_mem_usage|Zero-?3 is not compatible with "
                        r"passing a .?device_map|device_map.{0,80}not (compatible|supported).{0,40}(zero.?3|DeepSpeed))",
                        re.IGNORECASE)


# options of fine-tuning tools that load the model with a device_map of their own (the cause the user can change)
PLACING_OPTIONS = re.compile(r"(?:--|\b)(?P<option>use_unsloth|quantization_bit|load_in_4bit|load_in_8bit|"
                             r"device_map)(?:[ =:]+(?P<value>true|auto|\d+|[\w\"'{}:]+))?", re.IGNORECASE)
OFF = {"false", "0", "none", "null"}


def _from_pretrained_caller(f: Found) -> str:
    """The frame outside transformers that called from_pretrained (the user's script or a framework's loader), as
    `file:function`: the place the two arguments are passed."""
    from ..raised import final_exception
    raised = final_exception(f.log)
    frames = list(raised.frames) if raised else []
    for frame in reversed(frames):
        if "from_pretrained" in frame.code and frame.package != "transformers":
            name = re.split(r"[\\/]", frame.file)[-1]
            return f"{name} ({frame.func})"
    return ""


def diagnose_device_map(f: Found) -> Diagnosis:
    d = Diagnosis("zero3_device_map", "ZeRO-3 with from_pretrained(device_map=... / low_cpu_mem_usage=True): the "
                                      "loader and DeepSpeed both want to place the weights", f.line)
    options = [m.group("option") for m in f.log.all(PLACING_OPTIONS)
               if m.group("option").lower() != "device_map" and (m.group("value") or "true").lower() not in OFF]
    if options:
        option = options[0]
        d.proposal = Proposal(f"drop --{option} under ZeRO-3 (or train at ZeRO stage 2 with it)", [],
                              f"--{option} makes the tool load the model itself with a device_map (unsloth's "
                              "patched loader, bitsandbytes' quantized load), which ZeRO-3's partitioned loading "
                              "cannot take; the message names the device_map, the option in the command is its "
                              "cause")
        return d
    caller = _from_pretrained_caller(f)
    where = f" where {caller} calls it" if caller else ""
    d.proposal = Proposal(f"load with low_cpu_mem_usage=False and device_map=None under ZeRO-3 (from_pretrained{where})",
                          [],
                          "under ZeRO-3 transformers loads the model inside deepspeed.zero.Init, which partitions "
                          "every parameter across the ranks as it is created; device_map (accelerate's placement, "
                          "which sets low_cpu_mem_usage) and 8/4-bit loading place whole tensors on devices themselves. "
                          "Call from_pretrained without them and let DeepSpeed place the shards (this trainer does: "
                          "at stage 3 it loads under zero.Init with no device_map)")
    d.advice.append("to keep device_map (one process spreading a model over GPUs), run without ZeRO-3: that is model "
                    "parallelism for inference, not data-parallel training")
    return d


# --- tied weights refused by safetensors -----------------------------------------------------------------------

# safetensors' save_file writes each tensor's storage once per name and refuses two names over one storage: tied
# weights (an input embedding and lm_head) saved through a path that does not drop the duplicate first
SHARED_TENSORS = re.compile(r"(Some tensors share memory, this will lead to duplicate memory on disk|The weights trying to "
                            r"be saved contained shared tensors)")
# transformers' save_pretrained drops the duplicates its config declares tied, and refuses the others itself
UNDECLARED = re.compile(r"The weights trying to be saved contained shared tensors")
SHARED_NAMES = re.compile(r"\[\{([^}]*)\}")


def diagnose_shared_tensors(f: Found) -> Diagnosis:
    names = SHARED_NAMES.search(f.log.joined(f.index, following=2))
    tied = f" ({names.group(1)})" if names else ""
    if UNDECLARED.search(f.log.joined(f.index)):
        return _undeclared_sharing(f, tied)
    d = Diagnosis("shared_tensors", f"the save refused tensors that share storage{tied}: tied weights, written with "
                                    f"safetensors", f.line)
    d.proposal = Proposal(
        "save that checkpoint without safetensors: safe_serialization=False (accelerate's save_state / "
        "save_pretrained; the HF Trainer's save_safetensors=False) - torch.save keeps the shared storage", [],
        f"safetensors stores one tensor per name and refuses two names over one storage{tied}; the save that raised "
        "passes the raw state dict. Where you control the call, save_pretrained / safetensors' save_model drop the "
        "duplicate instead and keep safetensors")
    return d


def _undeclared_sharing(f: Found, tied: str) -> Diagnosis:
    d = Diagnosis("shared_tensors", f"save_pretrained refused tensors that share storage{tied} which the model's "
                                    f"config does not declare tied", f.line)
    d.proposal = Proposal(
        f"remove the shared tensor before saving: give one of them{tied} storage of its own (`x.weight = "
        f"torch.nn.Parameter(y.weight.clone())`), or declare the pair in the model's _tied_weights_keys", [],
        "save_pretrained drops only the duplicates the model declares tied (its _tied_weights_keys and the config's "
        "tie_word_embeddings); these share storage by an assignment in the model's code or the training script, so "
        "it refuses to pick one, and a reload would not tie them again")
    d.then.append(Proposal("or save without safetensors: safe_serialization=False (the HF Trainer's "
                           "save_safetensors=False)", [], "torch.save keeps the shared storage as it is"))
    return d


# --- a script told to write into a directory that is a file name ---------------------------------------------------

# torch.save's refusal when the file's directory does not exist: the path given was taken as a directory to write in
PARENT_MISSING = re.compile(r"Parent directory (?P<path>\S+?)\.? does not exist")
SCRIPT_RUN = re.compile(r"(?P<script>[\w.-]+\.py)\b(?P<args>[^\n]*)")


def diagnose_parent_missing(f: Found) -> Diagnosis:
    path = PARENT_MISSING.search(f.log.joined(f.index)).group("path")
    d = Diagnosis("parent_missing", f"a save into {path}/, a directory that does not exist", f.line)
    run = next((m for line in f.log.lines for m in [SCRIPT_RUN.search(line)] if m and path in m.group("args").split()),
               None)
    found = installed.script(run.group("script")) if run else None
    if run and found:
        package, file = found
        words = [w for w in run.group("args").split() if not w.startswith("-")]
        declared = installed.positionals(file)
        name, meaning = declared[words.index(path)] if words.index(path) < len(declared) else (path, "")
        d.proposal = Proposal(
            f"pass a directory as {run.group('script')}'s {name}: `{run.group('script')} "
            f"{' '.join(w if w != path else (path.rsplit('/', 1)[0] + '/' if '/' in path else '.') for w in words)}`",
            [], f"in {package} {installed.installed_version(package)} (installed here) its argument {name} is "
            f"\"{meaning}\": the script writes its files into it, so {path} was taken as a directory. Instructions "
            f"that pass a file there were written for an older {package}: use its form, or pin that release")
        return d
    d.proposal = Proposal(f"create the directory {path} first, or pass the directory the file should go in", [],
                          "torch.save writes into an existing directory only; the code took this path as that "
                          "directory")
    return d


# --- a partitioned placeholder used outside a gather -----------------------------------------------------------

# an operand of size 0 where the other has the model's width: under ZeRO-3 (or FSDP, outside its forward) a parameter
# is an empty placeholder until the engine gathers it for its own module's forward
EMPTY_OPERAND = re.compile(r"(The size of tensor [ab] \(0\) must match the size of tensor [ab] \(\d+\)|The size of tensor "
                           r"[ab] \(\d+\) must match the size of tensor [ab] \(0\)|shapes cannot be multiplied \(\d+x\d+ "
                           r"and 0x\d+\)|shapes cannot be multiplied \(\d+x0 and)")
IN_TRAINING = ("forward", "backward", "gather", "training", "step")


# (what happened, the change, why) by where the placeholder was read: inside training, or by code outside the engine
PLACEHOLDER_READ = {
    True: ("a ZeRO-3 parameter was used by a module other than the one that owns it: outside its gather it is an "
           "empty (size 0) placeholder",
           "register the parameter with the module that uses it: deepspeed.zero.register_external_parameter(module, "
           "param), or make that block one ZeRO-3 leaf (deepspeed.utils.set_z3_leaf_modules; here "
           "model.zero3_leaf_modules)",
           "ZeRO-3 gathers a parameter just before its own module's forward; code that reads it from another module "
           "(a tied weight, a shared projection, an expert router) sees the placeholder"),
    False: ("code that ran outside DeepSpeed's gathers used a ZeRO-3 placeholder (a size-0 parameter): merging, "
            "generating or exporting after a ZeRO-3 launch",
            "run that step without ZeRO-3: launch it with a plain multi-GPU (DDP) config instead of the DeepSpeed "
            "ZeRO-3 one, or on one process - or wrap it in deepspeed.zero.GatheredParameters(model.parameters())",
            "a model created under a ZeRO-3 launch is partitioned as it is built (zero.Init): merge_and_unload, "
            "generate or a state-dict copy outside the engine see empty parameters. A LoRA merge needs no DeepSpeed "
            "at all; a ZeRO-3 checkpoint is read outside DeepSpeed after `python -m deepspeed.utils.zero_to_fp32`"),
}


def diagnose_empty_operand(f: Found) -> Diagnosis:
    from ..phases import phase
    title, step, why = PLACEHOLDER_READ[phase(f.log, f.index) in IN_TRAINING]
    d = Diagnosis("zero3_placeholder", title, f.line)
    d.proposal = Proposal(step, [], why)
    return d
