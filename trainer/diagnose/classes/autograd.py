"""Two failures PyTorch reports in its own terms, whatever library drove it, read with what the log and the config
say about the run:

- **No gradient graph** ("element 0 of tensors does not require grad and does not have a grad_fn"): the loss is
  connected to no parameter that trains. With activation checkpointing in the reentrant form and a frozen input
  embedding (LoRA, or any frozen base), each checkpointed block's input does not require grad, so the reentrant
  checkpoint returns outputs without a graph: the inputs must require grad (`enable_input_require_grads`) or the
  checkpoint must be the non-reentrant one (`use_reentrant=False`, what this trainer uses). Without checkpointing,
  nothing trainable reached the loss: LoRA target modules that matched nothing, a loss computed under `no_grad`.
- **A token id past the embedding** (`srcIndex < srcSelectDimSize`, "index out of range in self"): an id at least
  the number of rows of the embedding it indexes - a tokenizer that grew (a pad or chat token added) without the
  model's embedding being resized, another model's tokenizer, or positions past a learned position table.
"""
from __future__ import annotations

import re
from typing import Optional

from ... import ds as dsc
from ..findings import Diagnosis, Found, Proposal
from ..logtext import Log
from ..raised import final_exception

NO_GRAPH = re.compile(r"element \d+ of tensors does not require grad and does not have a grad_fn")
# torch's reentrant checkpoint warns when no input of a checkpointed block requires grad: nothing inside that block
# gets a gradient, and a loss that depends only on such blocks has no graph - the error's cause, printed before it
NO_INPUT_GRAD = re.compile(r"None of the inputs have requires_grad=True\. Gradients will be None")
CHECKPOINTED = re.compile(r"(torch[\\/]utils[\\/]checkpoint\.py|gradient_checkpointing|use_reentrant|"
                          r"CheckpointFunction|activation_checkpointing)", re.IGNORECASE)
FROZEN_BASE = re.compile(r"(peft|lora|prepare_model_for_kbit_training|trainable params)", re.IGNORECASE)

PAST_EMBEDDING = re.compile(r"(srcIndex < srcSelectDimSize|index out of range in self|indexSelect(?:Large|Small)Index)")
EMBEDDING_FRAME = re.compile(r"(F\.embedding|torch[\\/]nn[\\/]functional\.py\S* in embedding|modules[\\/]sparse\.py|"
                             r"embed_tokens|wte|embed_positions|position_embeddings)")


def find_no_graph(log: Log) -> Optional[int]:
    """The error itself, else the checkpoint's warning when the log ends in a traceback after it (a paste cut
    before the error's line)."""
    index = log.first(NO_GRAPH)
    if index is not None:
        return index
    warned = log.first(NO_INPUT_GRAD)
    raised = final_exception(log) if warned is not None else None
    return warned if raised is not None and raised.index > warned else None


find_no_graph.signature = (NO_GRAPH, NO_INPUT_GRAD)


def diagnose_no_graph(f: Found) -> Diagnosis:
    text = f.log.text
    checkpointed = bool(CHECKPOINTED.search(text)) or f.resolved.config.model.gradient_checkpointing
    frozen = bool(FROZEN_BASE.search(text)) or f.resolved.config.model.lora.enabled
    d = Diagnosis("no_gradient_graph", "the loss has no gradient graph: no parameter that trains reached it", f.line)
    if checkpointed and frozen:
        d.proposal = Proposal(
            "make the checkpointed blocks' inputs require grad: `model.enable_input_require_grads()` before "
            "wrapping the model with PEFT, or non-reentrant checkpointing: `model.gradient_checkpointing_enable("
            "gradient_checkpointing_kwargs={\"use_reentrant\": False})`", [],
            "with the base model frozen (LoRA), the embedding's output does not require grad; torch's reentrant "
            "activation checkpoint then returns each block's output without a graph, and the loss has none. This "
            "trainer checkpoints with use_reentrant=False (trainer/model.py), so its own runs are not affected")
        d.then.append(Proposal("or check that something trains", [],
                               "`model.print_trainable_parameters()` after PEFT wraps it: 0 trainable parameters "
                               "means the LoRA target_modules matched no layer of this model"))
        return d
    d.proposal = Proposal(
        "check that trainable parameters reach the loss: `model.print_trainable_parameters()`", [],
        "0 trainable parameters means every parameter is frozen (LoRA target_modules that match no layer, a "
        "`requires_grad_(False)` on the whole model); otherwise the loss was computed under `torch.no_grad()` / "
        "`inference_mode()`, or from tensors detached from the model (labels only, a `.detach()` or `.item()`)")
    if frozen:
        d.then.append(Proposal("with gradient checkpointing on a frozen base: make its inputs require grad", [],
                               "`model.enable_input_require_grads()` or `use_reentrant=False`"))
    return d


# --- a recomputation that differs from the forward (torch's non-reentrant checkpoint) ---------------------------

RECOMPUTED = re.compile(r"Recomputed values for the following tensors have different metadata than during the "
                        r"forward pass")


def diagnose_recomputed(f: Found) -> Diagnosis:
    """Non-reentrant checkpointing checks that the recomputed forward saves tensors of the same shape and dtype as
    the first one. Under ZeRO-3 the first forward ran with each layer's parameters gathered and the recomputation can
    see them partitioned (shape [0]) - the gather happens in module hooks the recomputation does not go through in
    the same way - so the check fails on a parameter; reentrant checkpointing reruns the module, hooks included."""
    sharding = f.facts.sharding
    stage3 = (sharding or {}).get("stage") == 3 or (sharding is None and dsc.zero_stage(f.resolved.ds) == 3)
    d = Diagnosis("checkpoint_recompute", "the recomputed forward of a checkpointed block saved tensors of other "
                                          "shapes than the first forward", f.line)
    if stage3:
        d.proposal = Proposal("use reentrant activation checkpointing under ZeRO-3: gradient_checkpointing_kwargs="
                              "{\"use_reentrant\": True} (or train at ZeRO stage 2)", [],
                              "torch's non-reentrant checkpoint compares the recomputed tensors' metadata with the "
                              "forward's; under ZeRO-3 a layer's parameters are gathered by module hooks in the "
                              "forward and may be seen partitioned (torch.Size([0])) in the recomputation, so the "
                              "comparison fails. Reentrant checkpointing reruns the modules with their hooks")
        stage2 = dsc.zero_overrides(f.resolved.ds, dsc.base_config(2, dsc.offload_optimizer_device(f.resolved.ds), "none"))
        d.then.append(Proposal("or ZeRO stage 2, where parameters are not partitioned",
                               stage2 if f.resolves(stage2) is not None else [],
                               "stage 2 keeps whole parameters on every rank: the recomputation sees what the forward "
                               "saw (more GPU memory for the parameters)"))
        return d
    d.proposal = Proposal("make the checkpointed forward deterministic in shape, or use reentrant checkpointing "
                          "(use_reentrant=True)", [],
                          "the recomputation ran under another autocast or dtype, or a shape depends on something "
                          "that changed between the two passes (a random choice, a cache, a global flag)")
    return d


# --- a gradient reduced twice in one backward (ZeRO-1/2's per-parameter hooks) ------------------------------------

# ZeRO-1/2 reduce each parameter's gradient from a hook that runs when autograd accumulates it; autograd sums every use
# of a parameter within one graph before that, so the hook runs twice only when one backward accumulates it twice:
# reentrant activation checkpointing runs an inner backward per checkpointed block, so a parameter used in two such
# blocks (or a model called twice before one backward, with checkpointing on) is accumulated once per block
REDUCED_TWICE = re.compile(r"(has already been reduced\.?\s+Gradient computed twice|Gradient computed twice for this "
                           r"partition)")


def diagnose_reduced_twice(f: Found) -> Diagnosis:
    checkpointed = bool(CHECKPOINTED.search(f.log.text)) or f.resolved.config.model.gradient_checkpointing
    d = Diagnosis("reduced_twice", "ZeRO's gradient hook ran twice for one parameter in one backward", f.line)
    why = ("ZeRO-1/2 reduce a parameter's gradient from a hook that runs when autograd accumulates it, and autograd "
           "sums a parameter's uses within one graph first, so the hook runs once per backward - unless ")
    if checkpointed:
        off = ["model.gradient_checkpointing=false"]
        d.proposal = Proposal("turn off gradient checkpointing (or make it non-reentrant: gradient_checkpointing_kwargs="
                              "{\"use_reentrant\": False})", off if f.resolves(off) is not None else [],
                              why + "reentrant activation checkpointing runs a backward of its own per checkpointed "
                              "block: a parameter used in two blocks, or a model called twice before one backward (a "
                              "bi-encoder's query and passage), is accumulated once per block. Non-reentrant "
                              "checkpointing (this trainer's) keeps one graph; without checkpointing, more activation "
                              "memory")
        return d
    d.proposal = Proposal("accumulate each parameter once per backward: call the model once per step (both inputs in "
                          "one batch) or train this model at ZeRO stage 0", [],
                          why + "a backward runs in pieces (a loss backpropagated twice with retain_graph, a module "
                          "that calls torch.autograd.backward itself)")
    return d


def diagnose_past_embedding(f: Found) -> Diagnosis:
    raised = final_exception(f.log)  # the device-side assert is printed before the traceback that reports it
    frames = [*f.log.frames(f.index), *(raised.frames if raised else ())]
    at_embedding = any(EMBEDDING_FRAME.search(f"{frame.file} {frame.func} {frame.code}") for frame in frames)
    where = "an embedding" if at_embedding else "an index (most often an embedding's)"
    d = Diagnosis("token_past_embedding", f"a token id past the rows of {where}: a tokenizer that does not match "
                                          "the model's embedding", f.line)
    d.proposal = Proposal(
        "resize the model's embedding to the tokenizer after adding tokens: `model.resize_token_embeddings("
        "len(tokenizer))`", [],
        "an id at least the embedding's row count: a pad or chat-template token added to the tokenizer (its id is "
        "the old vocabulary size) without resizing, or a tokenizer of another model. `max(input_ids)` against "
        "`model.get_input_embeddings().num_embeddings` shows which. This trainer resizes a pretrained model's "
        "embedding to its tokenizer (model.fit_embeddings) and refuses a tokenizer larger than model.vocab_size "
        "for a model built from scratch")
    d.then.append(Proposal("or shorten the sequences to the model's position table", [],
                           "a model with learned absolute positions (GPT-2, OPT, BERT) fails the same way on a "
                           "sequence longer than max_position_embeddings: set data.seq_len at most that"))
    d.advice.append("on GPU the failing index is reported asynchronously: CUDA_LAUNCH_BLOCKING=1 (or a CPU run of "
                    "one batch) shows the line that indexes")
    return d


# AMP's GradScaler refuses to unscale gradients of fp16 parameters: the trainable weights are fp16 themselves
FP16_TRAINABLE = re.compile(r"Attempting to unscale FP16 gradients")


def diagnose_fp16_trainable(f: Found) -> Diagnosis:
    d = Diagnosis("fp16_trainable", "the parameters being trained are fp16 themselves, under fp16 mixed precision",
                  f.line)
    lora = bool(re.search(r"\b(peft|lora|LoraConfig|get_peft_model)\b", "\n".join(f.log.lines), re.IGNORECASE))
    d.proposal = Proposal(
        "keep the trainable parameters in float32 (fp32): load the model in float32, or cast the ones that require "
        "grad (`for p in model.parameters(): if p.requires_grad: p.data = p.data.float()`)"
        + ("; with LoRA on an fp16 base, PEFT releases differ in whether they create the adapters in fp32 - use the "
           "PEFT release the script was written for" if lora else ""), [],
        "fp16 mixed precision keeps fp32 master weights and scales the loss; a model loaded in fp16 gives the optimizer "
        "fp16 parameters, whose gradients the GradScaler refuses to unscale")
    d.then.append(Proposal("or train in bf16 (Ampere or newer): no loss scaler at all", [],
                           "this trainer: train.precision=bf16"))
    return d
