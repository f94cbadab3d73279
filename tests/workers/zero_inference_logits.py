"""Under `deepspeed --num_gpus 2`: the logits of ZeRO-Inference (ZeRO-3, parameters offloaded to CPU) next to
the plain model's, on the same prompt, on every rank. Writes {rank: max |difference|} to OUT.json (rank 0)."""
import argparse
import json
from types import SimpleNamespace

import torch
import torch.distributed as dist

from trainer.infer.session import check_arguments, open_session
from trainer.infer.source import load_model


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    args, _ = parser.parse_known_args()  # the launcher adds --local_rank
    flags = SimpleNamespace(model=args.model, trust_remote_code=False, tp=1, dtype="fp32", kernel_inject=False,
                            zero_inference="cpu", nvme_path=None)
    request = check_arguments(flags)
    ids = torch.tensor([[1, 17, 42, 99, 7, 300, 12, 5]])
    plain = load_model(request.source, torch.float32)(input_ids=ids).logits
    with open_session(flags, request) as session:
        assert session.runner.mode == "zero-cpu", session.runner.mode
        partitioned = [p for p in session.runner.module.parameters() if hasattr(p, "ds_id")]
        assert partitioned, "ZeRO-3 did not partition the model"
        with torch.no_grad():
            logits = session.runner.module(input_ids=ids.to(session.runner.device)).logits.cpu()
        diff = torch.tensor([float((logits - plain).abs().max())])
        gathered = [torch.zeros(1) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, diff)
        if dist.get_rank() == 0:
            json.dump({"max_diff": [float(g) for g in gathered], "offloaded": session.runner.mode}, open(args.out, "w"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
