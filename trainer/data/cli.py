"""`python -m trainer prepare-data`: tokenize a preset's sources (or one source) once into token shards.

    python -m trainer prepare-data --preset 1b_pretrain_8xh100          # into the cache where training looks
    python -m trainer prepare-data --source corpus/ --tokenizer meta-llama/Llama-3.2-1B --task pretrain \\
        --out /data/prepared/corpus                                        # then data.source: /data/prepared/corpus

It runs on one machine, over its cores (`--num-proc`, default all), prints tokens/s, and can be stopped and
rerun: finished shards are kept and the result is byte-identical to an uninterrupted run.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from .. import numbers, paths
from ..config import DataConfig, ModelConfig
from ..errors import UserError
from ..presets import blamed, load_preset, preset_path
from ..resolve import resolve
from . import RECORDS_PER_SHARD


def prepare_data_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", help="prepare every source of this preset where its training will look")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a preset value (repeatable)")
    parser.add_argument("--source", help="without --preset: a local file/directory or a hub dataset name")
    parser.add_argument("--tokenizer", help="without --preset: tokenizer directory or hub id")
    parser.add_argument("--task", choices=("pretrain", "sft", "preference"), default="pretrain", help="without --preset")
    parser.add_argument("--seq-len", type=numbers.SEQUENCE_TOKENS, default=2048,
                        help="without --preset, sft and preference: samples are fitted to it")
    parser.add_argument("--out", type=paths.output_dir("output directory"),
                        help="without --preset: the output directory (new, empty, or an interrupted run)")
    parser.add_argument("--records-per-shard", type=numbers.COUNT, default=RECORDS_PER_SHARD,
                        help=f"records per shard (default {RECORDS_PER_SHARD:,}); the unit a rerun keeps")
    parser.add_argument("--num-proc", type=numbers.PROCESSES, default=numbers.available_cores(),
                        help="tokenizer processes (default: every core this process may use)")


def prepare_data(args) -> int:
    from .prepare import check_cache_parent, is_prepared, prepare  # datasets, numpy: not for `--help`
    jobs = preset_jobs(args) if args.preset else [single_job(args)]
    for data_cfg, tokenizer, source, out in jobs:
        if is_prepared(str(out)) and out == Path(source).expanduser():
            print(f"prepare-data: {source} is prepared data already", file=sys.stderr)
            continue
        if args.preset:  # into the automatic cache, which training verifies as this user's
            out.parent.mkdir(parents=True, exist_ok=True)
            check_cache_parent(out.parent)
        with contextlib.redirect_stdout(sys.stderr):
            manifest = prepare(data_cfg, source, tokenizer, out, args.records_per_shard, args.num_proc, progress=True)
        counts = {split: f"{info['tokens']:,} tokens in {info['documents']:,} documents"
                  for split, info in manifest["splits"].items()}
        print(f"prepared {source} -> {out} ({manifest['dtype']}): train {counts['train']}, eval {counts['eval']}")
    return 0


def preset_jobs(args) -> list[tuple]:
    from .build import sources_of
    from .prepare import prepared_path
    from .tokenize import apply_chat_template, load_tokenizer
    if args.source or args.out or args.tokenizer:
        raise UserError("--preset prepares the preset's own sources where its training looks; drop --source, "
                        "--tokenizer and --out (or drop --preset)")
    with contextlib.redirect_stdout(sys.stderr):  # the config training would get: every check train makes
        # resolved as written (not options.load_and_resolve, which imports this package for train.epochs)
        with blamed(str(preset_path(args.preset)), args.overrides, alone=lambda: resolve(load_preset(args.preset))):
            cfg = resolve(load_preset(args.preset, args.overrides)).config
    if cfg.data.task == "grpo":
        raise UserError(f"{args.preset} is a GRPO preset (data.task=grpo): its prompts are read, checked and tokenized "
                        f"by every rank at start, with nothing to prepare; train it directly (docs/rl.md)")
    tokenizer = apply_chat_template(load_tokenizer(cfg.model), cfg.data)  # as training renders chat records
    return [(cfg.data, tokenizer, source, prepared_path(cfg.data, source, tokenizer))
            for _, source, _ in sources_of(cfg.data)]


def single_job(args) -> tuple:
    from .tokenize import load_tokenizer
    missing = [flag for flag, value in (("--source", args.source), ("--tokenizer", args.tokenizer),
                                        ("--out", args.out)) if not value]
    if missing:
        raise UserError(f"{', '.join(missing)} needed (or --preset NAME to prepare a preset's sources)")
    data_cfg = DataConfig(task=args.task, source=args.source, seq_len=args.seq_len)
    tokenizer = load_tokenizer(ModelConfig(tokenizer=args.tokenizer))
    return data_cfg, tokenizer, args.source, Path(args.out).expanduser()
