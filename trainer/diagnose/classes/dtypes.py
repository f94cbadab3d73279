"""Two dtypes where one was expected, and NaN out of a backward: the precision the run's parts were given.

A message that two tensors' dtypes differ ("expected scalar type Half but found Float", "self and mat2 must have the
same dtype", "output tensor must have the same type as input tensor") says that two parts of the run were put in
different precisions; where it was raised says which parts:
- inside a ZeRO-3 gather (DeepSpeed's all-gather of a parameter's partitions, often while from_pretrained loads):
  the partitions were cast to the config's precision and the checkpoint's own dtype differs - make the config's
  precision the checkpoint's (a bf16 model: bf16, not fp16);
- in a run that quantizes (4-/8-bit): the quantized layers and the adapters compute in different dtypes - the peft
  and bitsandbytes releases that cast 4-bit LoRA layers, and the compute dtype set to the training precision;
- elsewhere: one dtype for the whole model (cast it, or load it in the training precision) and mixed precision's
  autocast for the activations.
`Function 'XBackward0' returned nan values` (autograd's anomaly mode) under fp16 is fp16's range: bf16 where the GPU
has it, else fp32.
"""
from __future__ import annotations

import re

from ... import ds as dsc
from ..findings import Diagnosis, Found, Proposal
from ..raised import final_exception

DTYPE_MISMATCH = re.compile(
    r"(expected scalar type \w+ but found \w+|(?:self and mat2|mat1 and mat2|input and weight|query, key,? and value) "
    r"(?:must|should) have the same dtype|output tensor must have the same type as input tensor|Input type \([\w:.]+\) "
    r"and (?:weight|bias) type \([\w:.]+\) should be the same|expected (?:mat1 and mat2|both inputs) to have the same "
    r"dtype)", re.IGNORECASE)
NAN_BACKWARD = re.compile(r"Function '(\w+)' returned nan values in its \d+(?:st|nd|rd|th) output")
GATHER_SITE = re.compile(r"(all_gather|_allgather|allgather|partition_parameters|_convert_to_deepspeed_param|"
                         r"fetch_sub_module|stage3)")
QUANTIZED = re.compile(r"(load_in_4bit|load_in_8bit|quantization_bit|bnb_4bit|BitsAndBytesConfig|Linear4bit|Linear8bitLt|"
                       r"--quantization|qlora)", re.IGNORECASE)
# ASCII word edges: "设置成 f16和load_in_4bit" is f16 beside Chinese, which \b counts as letters
FP16 = re.compile(r"(?<![A-Za-z0-9_])(?:--fp16|fp16|f16|float16|half)(?![A-Za-z0-9_])", re.IGNORECASE)


def find_mismatch(log):
    raised = final_exception(log)
    if raised is not None and DTYPE_MISMATCH.search(raised.headline):
        return raised.index
    return log.last(DTYPE_MISMATCH)


def diagnose_mismatch(f: Found) -> Diagnosis:
    raised = final_exception(f.log)
    frames = " ".join(f"{fr.file} {fr.func} {fr.code or ''}" for fr in (raised.frames if raised else ()))
    text = f.log.text
    if GATHER_SITE.search(frames) or GATHER_SITE.search(f.log.before(f.index, 6)):
        d = Diagnosis("dtype_mismatch", "a ZeRO-3 gather met partitions of two dtypes: the checkpoint's own dtype "
                                        "and the config's precision differ", f.line)
        bf16 = f.gpu.bf16
        to_bf16 = [] if dsc.precision(f.resolved.ds) == "bf16" or not bf16 else ["train.precision=bf16"] + \
            dsc.precision_overrides(f.resolved.ds, "bf16")
        d.proposal = Proposal(
            "switch fp16 to bf16 in the DeepSpeed config and the training arguments (\"bf16\": {\"enabled\": \"auto\"}, "
            "--bf16), the dtype most checkpoints ship in" if bf16 else
            "load the model in the config's precision: from_pretrained(..., torch_dtype=torch.float16)",
            to_bf16 if to_bf16 and f.resolves(to_bf16) is not None else [],
            "ZeRO-3 partitions each parameter as it is created and all-gathers the partitions in one dtype; a model "
            "whose weights come in bf16 under an fp16 config (or the other way) gathers tensors of two types")
        return d
    if QUANTIZED.search(text):
        d = Diagnosis("dtype_mismatch", "a quantized run's layers compute in two dtypes (the quantized base and the "
                                        "adapters)", f.line)
        d.proposal = Proposal(
            "upgrade peft and bitsandbytes together (pip install -U peft bitsandbytes: 4-bit LoRA layers cast to the "
            "compute dtype in the releases that know Linear4bit) and set bnb_4bit_compute_dtype to the training "
            "precision", [],
            "a 4-/8-bit layer dequantizes to its compute dtype; an adapter or a layer kept in another dtype (an older "
            "peft that does not cast, fp32 layer norms) meets it in one matmul")
        return d
    d = Diagnosis("dtype_mismatch", "two parts of the model are in different dtypes", f.line)
    d.proposal = Proposal(
        "cast the whole model to one dtype (model.half() / model.to(torch.bfloat16), or load it with torch_dtype) "
        "and let mixed precision cast the activations; under fp16 AMP run evaluation inside torch.autocast too", [],
        "a layer's weights and its input come from different precisions: part of the model was kept in fp32 (layer "
        "norms, a head) or a step ran outside the autocast the training step uses")
    return d


def find_nan_backward(log):
    index = log.last(NAN_BACKWARD)
    return index if index is not None and FP16.search(log.text) else None


def diagnose_nan_backward(f: Found) -> Diagnosis:
    op = NAN_BACKWARD.search(f.log.line(f.index)).group(1)
    gpu = f.gpu
    d = Diagnosis("nan_backward", f"{op} returned NaN in the backward of an fp16 run: fp16's range", f.line)
    target = "bf16" if gpu.bf16 else "fp32"
    already = dsc.precision(f.resolved.ds) == target  # the preset trains so already: its rerun is the change
    overrides = [] if already else ["train.precision=" + target] + dsc.precision_overrides(f.resolved.ds, target)
    resolved = f.resolves(overrides) if overrides else None
    d.proposal = Proposal(
        f"train in {target} instead of fp16" + (f", as {f.resolved.config.name} does" if already else "") +
        ("" if gpu.bf16 else f" ({gpu.description} has no bf16: full precision "
                                                                    f"float32)"),
        overrides if resolved is not None else [],
        "fp16 overflows past 65504 and underflows below 6e-8; a log-sigmoid or softmax of large logits in fp16 gives "
        "inf and then NaN in its gradient. " + ("bf16 keeps fp32's range" if gpu.bf16 else
                                                "fp32 needs about twice the memory of fp16 - a smaller model or "
                                                "micro-batch may be needed"))
    return d
