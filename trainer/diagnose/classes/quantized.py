"""A quantized base model (bitsandbytes 8-bit or 4-bit, the QLoRA recipe) placed where training cannot use it.
Such weights cannot be moved after loading (no `.to()`), so where they live is decided by `device_map` at
`from_pretrained`: `device_map="auto"` spreads one copy over every visible GPU (a model-parallel layout that data
parallel ranks cannot train), and a copy loaded on one GPU is on the wrong device for every other rank. Each rank
loads its own copy on its own device; CPU or disk offload of quantized weights is refused altogether.
"""
from __future__ import annotations

import re

from ..findings import Diagnosis, Found, Proposal

PLACEMENT = re.compile(r"(loaded in (?:8-bit|4-bit|8-bit or 4-bit|8bit|4bit) precision (?P<where>on multiple devices|on "
                       r"a different device|with CPU or disk offload)|Calling `?\.to\(\)`? is not supported for `?"
                       r"(?:4-bit|8-bit)`? (?:or `?(?:4-bit|8-bit)`? )?(?:bitsandbytes )?models)", re.IGNORECASE)

OWN_DEVICE = ('`device_map={"": Accelerator().local_process_index}` (or `{"": int(os.environ["LOCAL_RANK"])}`) in '
              'from_pretrained')


def diagnose(f: Found) -> Diagnosis:
    m = PLACEMENT.search(f.log.joined(f.index))
    where = (m.group("where") or "").lower() if m else ""
    if "offload" in where:
        d = Diagnosis("quantized_placement", "a quantized model with CPU or disk offload cannot be trained", f.line)
        d.proposal = Proposal("load the quantized model wholly on each rank's GPU: " + OWN_DEVICE, [],
                              "quantized weights offloaded by device_map (to 'cpu' or 'disk') cannot take part in "
                              "training; if it does not fit, 4-bit instead of 8-bit, a smaller micro-batch, or no "
                              "quantization with ZeRO-3 and its parameter offload (which shards the weights)")
        return d
    d = Diagnosis("quantized_placement", "a quantized (8-bit/4-bit) model is not on each rank's own device", f.line)
    d.proposal = Proposal(
        "load the quantized model on each rank's own device: " + OWN_DEVICE, [],
        "bitsandbytes weights cannot be moved after loading, so device_map decides where they live: "
        "device_map='auto' spreads one copy over every GPU (model parallel, which data-parallel ranks cannot train), "
        "a copy on cuda:0 is on the wrong device for every other rank. Accelerate releases before 0.20 refused "
        "this even for a correct per-rank placement: upgrade accelerate if the placement is already per rank")
    return d
