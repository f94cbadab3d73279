"""Save and resume real engines through trainer.train.checkpoint, one per configuration: what
tests/test_checkpoint_io.py asserts. Runs inside conftest's engine_runs launch (tests/workers/run_many.py calls
`run(SPEC)`), or alone under `deepspeed --num_gpus N`:
    python tests/workers/checkpoint_roundtrip.py SPEC.json
SPEC: {"out": dir, "report": path, "base": [--set items], "configs": {name: [--set items]}}. For each config: build an
engine, take two steps, save it with checkpoint.save; build a second engine, verify and load the checkpoint into it
with checkpoint.verify/load; then both engines take the same step. Rank 0 writes {name: findings}:
  manifest_mismatches  files whose size or SHA-256 on disk differ from the manifest's, or that it does not list
  weights_equal        the loaded engine's weights (this rank's partition) equal the saver's, bit for bit (all ranks)
  optimizer_equal      its optimizer state and fp32 master weights equal the saver's, bit for bit (all ranks)
  mapped_after_load    lines of /proc/self/maps naming a file of the checkpoint once the load returned (all ranks)
  losses               each engine's losses on the two steps after the load ([saver's], [loader's]): the second
                       follows an update with the loaded optimizer state; equal when the resume is exact
"""
import argparse
import json
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from trainer.distributed import all_gather_text, comm_device, end_distributed
from trainer.model import build_model
from trainer.presets import load_preset
from trainer.resolve import resolve
from trainer.train import checkpoint, checkpoint_io, integrity


def build_engine(overrides: list[str]):
    world = dist.get_world_size()
    cfg = resolve(load_preset("tiny_cpu", overrides + [f"hardware.gpus_per_node={world}"]), world).config
    model, _ = build_model(cfg, dist.get_rank())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg.deepspeed)
    return engine, cfg


def train_step(engine, batch) -> float:
    loss = engine(input_ids=batch, labels=batch).loss
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def weights(engine) -> list:
    return [getattr(p, "ds_tensor", None) if getattr(p, "ds_tensor", None) is not None else p.data
            for p in engine.module.parameters()]


def optimizer_tensors(engine) -> list:
    found = [t for _, t in integrity._master_weights(engine)]
    for optimizer in checkpoint_io._torch_optimizers(engine.optimizer):
        for group in optimizer.param_groups:
            for param in group["params"]:
                found += [v for _, v in sorted(optimizer.state.get(param, {}).items()) if torch.is_tensor(v)]
    return found


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x.cpu(), y.cpu()) for x, y in zip(a, b))


def mapped_files(under: Path) -> list[str]:
    return [line.strip() for line in Path("/proc/self/maps").read_text().splitlines() if str(under) in line]


def manifest_mismatches(path: Path) -> list[str]:
    listed = integrity.read_manifest(path)["files"]
    on_disk = integrity.checkpoint_files(path)
    wrong = [f"{name}: not listed" for name in on_disk if name not in listed]
    for name, entry in listed.items():
        file = path / name
        actual = {"bytes": file.stat().st_size, "sha256": integrity.sha256_file(file)} if file.is_file() else None
        if actual != entry:
            wrong.append(f"{name}: manifest {entry}, disk {actual}")
    return wrong


def roundtrip(name: str, overrides: list[str], out: Path) -> dict:
    torch.manual_seed(0)
    batches = [torch.randint(0, 256, (2, 32)) for _ in range(3)]
    saver, cfg = build_engine(overrides)
    for batch in batches[:2]:
        train_step(saver, batch)
    ckpt_dir = out / name / "checkpoints"
    path = checkpoint.save(saver, ckpt_dir, checkpoint.TrainState(step=2), {"model": {}}, keep_last=1)
    loader, _ = build_engine(overrides)
    checkpoint.verify(path, comm_device())
    checkpoint.load(loader, path, ckpt_dir)
    mapped = mapped_files(path)
    findings = {"weights_equal": same(weights(saver), weights(loader)),
                "optimizer_equal": same(optimizer_tensors(saver), optimizer_tensors(loader)),
                "mapped_after_load": mapped,
                "losses": [[train_step(engine, batch) for batch in (batches[2], batches[0])] for engine in (saver, loader)]}
    everyone = [json.loads(part) for part in all_gather_text(json.dumps(findings), comm_device())]
    result = {"weights_equal": all(f["weights_equal"] for f in everyone),
              "optimizer_equal": all(f["optimizer_equal"] for f in everyone),
              "mapped_after_load": [m for f in everyone for m in f["mapped_after_load"]],
              "losses": [f["losses"] for f in everyone],
              "manifest_mismatches": manifest_mismatches(path) if dist.get_rank() == 0 else None}
    for engine in (saver, loader):
        engine.destroy()
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("spec")
    args, _ = parser.parse_known_args()  # the launcher adds --local_rank
    deepspeed.init_distributed(dist_backend="gloo")
    run(json.loads(Path(args.spec).read_text()))
    end_distributed()
    return 0


def run(spec: dict) -> None:
    """Every configuration of SPEC in the process group already started; rank 0 writes the report."""
    report = {name: roundtrip(name, spec["base"] + extra, Path(spec["out"])) for name, extra in spec["configs"].items()}
    if dist.get_rank() == 0:
        Path(spec["report"]).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    sys.exit(main())
