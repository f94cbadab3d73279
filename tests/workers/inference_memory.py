"""What DeepSpeed really does at inference, for tests/test_plan_inference.py (under `deepspeed --num_gpus 2`):

- ZeRO-Inference: each config the planner writes (zero-cpu, zero-nvme) through `deepspeed.initialize`, then
  greedy `generate` on both ranks, compared with the plain model's tokens;
- AutoTP: `deepspeed.init_inference(model, tensor_parallel={"tp_size": 2})` on each architecture, and the
  parameters every rank then holds (each tensor once: a tied weight counts once).

Usage: python tests/workers/inference_memory.py SPEC.json
SPEC: {"architectures": {name: ModelConfig fields}, "zero_model": name, "nvme_dir": path, "report": path}.
"""
import argparse
import json

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from trainer import ds as dsc
from trainer.config import ModelConfig
from trainer.distributed import end_distributed
from trainer.model import hf_config
from trainer.plan.memory import largest_layer_params


def build(fields: dict):
    torch.manual_seed(0)  # the same weights on every rank and for every copy
    return AutoModelForCausalLM.from_config(hf_config(ModelConfig(**fields), "sdpa")).eval()


def zero_inference_matches(fields: dict, nvme_dir: str) -> dict:
    """Greedy tokens under each ZeRO-Inference config equal the plain model's."""
    config = ModelConfig(**fields)
    prompt = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    generation = dict(attention_mask=torch.ones_like(prompt), pad_token_id=0, max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        want = build(fields).generate(prompt, **generation)
    out = {}
    for mode in ("zero-cpu", "zero-nvme"):
        ds = dsc.zero_inference_config(mode, nvme_dir, largest_layer=largest_layer_params(config), dtype="fp32")
        engine, *_ = deepspeed.initialize(model=build(fields), config=ds)
        with torch.no_grad():  # synced_gpus: ZeRO-3 ranks gather parameters together every step
            got = engine.module.generate(prompt, synced_gpus=True, **generation)
        out[mode] = bool(torch.equal(got, want))
    return out


def autotp_rank_params(fields: dict) -> list[int]:
    """Parameters this rank holds after AutoTP, gathered from every rank (rank order)."""
    engine = deepspeed.init_inference(build(fields), tensor_parallel={"tp_size": 2}, dtype=torch.float32,
                                      replace_with_kernel_inject=False)
    mine = sum(p.numel() for p in engine.module.parameters())  # parameters() yields a shared tensor once
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("spec")
    args, _ = parser.parse_known_args()  # the launcher adds --local_rank
    spec = json.load(open(args.spec))
    deepspeed.init_distributed()
    report = {"zero": zero_inference_matches(spec["architectures"][spec["zero_model"]], spec["nvme_dir"]),
              "autotp": {name: autotp_rank_params(fields) for name, fields in spec["architectures"].items()}}
    if dist.get_rank() == 0:
        json.dump(report, open(spec["report"], "w"), indent=1)
    end_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
