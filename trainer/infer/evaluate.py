"""`python -m trainer evaluate`: loss and perplexity of a model on a dataset, through training's own data path;
on preference pairs, DPO's loss, preference accuracy and reward margin against a reference model.

    python -m trainer evaluate --model runs/tiny_cpu                     # the run's own eval set and settings
    python -m trainer evaluate --model runs/tiny_cpu --data held_out.jsonl
    deepspeed --num_gpus 2 --module trainer evaluate --model runs/tiny_cpu --preset tiny_cpu
    python -m trainer evaluate --model runs/dpo --data pairs.jsonl --task preference   # reference: the run's start

The eval set is training's (train/evaluation.py): the first train.eval_sequences sequences of each eval split, the
same at every world size, so a run directory evaluates to the run's final eval_loss on any number of ranks.
Prints one JSON object on stdout: eval_loss, eval_ppl, tokens, sequences (+ eval_loss/<source> per source).

Preference data (data.task=preference) is scored by training's own objective (train/preference.py) with the run's
preference settings (beta, loss), so the numbers are the loop's eval_loss and eval_rewards/* for the same weights
and pairs: eval_rewards/accuracy (share of pairs whose chosen log-ratio beats the rejected one) and
eval_rewards/margin (their mean difference, times beta), with eval_rewards/chosen and /rejected. The reference is
the model the run started from, whatever preference.reference it trained with (the adapter-disabled LoRA base, the
frozen engine and the precomputed log-probs are all those weights): model.name_or_path (LoRA: the base), or the
seeded init of a run from scratch; --reference SRC names another. It is placed like the evaluated model.

GRPO prompts (data.task=grpo, or --task grpo with --data) get one greedy completion each, scored by the config's
grpo.rewards (train/rl/objective.py evaluate_prompts): reward/mean, reward/<fn>, accuracy, completion_length.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from typing import Any, Callable

from .. import numbers, paths
from .. import ranks
from ..config import Config
from ..errors import UserError
from ..files import check_target, write_text_atomic
from ..options import resolved_with_overrides
from ..presets import load_preset, preset_path
from ..train.evaluation import EvalSet
from ..train.evaluation import evaluate as evaluate_set
from ..train.sequence_parallel import forward_inputs
from .runner import DTYPES, start_runner
from .session import Request, add_model_arguments, check_arguments, open_session
from .source import ModelSource, architecture, load_model, resolve_source


def evaluate_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    data = parser.add_mutually_exclusive_group()
    data.add_argument("--preset", help="evaluate on this preset's eval data (default: the run's own config)")
    data.add_argument("--data", metavar="SOURCE",
                      help="evaluate on this file, directory or hub dataset: all of it, unless --eval-sequences")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override the preset's (or run's) config, e.g. data.seq_len=512")
    parser.add_argument("--task", choices=("pretrain", "sft", "preference", "grpo"),
                        help="with --data: how to read it (grpo: prompt + answer records, scored by the rewards)")
    parser.add_argument("--reference", metavar="SRC",
                        help="preference data: the reference model (HF directory or hub id); default: the weights "
                             "the run started from (its model.name_or_path, the LoRA base, or its seeded init)")
    parser.add_argument("--seq-len", type=numbers.SEQUENCE_TOKENS, help="with --data: tokens per sequence")
    parser.add_argument("--eval-sequences", type=numbers.COUNT,
                        help="sequences to evaluate from each eval split (default: all of --data, else "
                             "train.eval_sequences)")
    parser.add_argument("--batch-size", type=numbers.COUNT,
                        help="sequences per forward (default: train.micro_batch_size)")
    parser.add_argument("-o", "--output", type=paths.output_file("output file"),
                        help="write the JSON here instead of stdout (rank 0)")


def evaluate(args) -> int:
    if args.output:
        check_target(args.output)
    request = check_arguments(args)
    cfg = data_config(args, request.source, int(request.hf_config.max_position_embeddings))
    preference = cfg.data.task == "preference"
    if args.reference is not None and not preference:
        raise UserError("--reference is the reference model of preference pairs; the data here is "
                        f"data.task={cfg.data.task}: drop --reference, or evaluate pairs with --task preference")
    reference = reference_source(args, request) if preference else None
    if cfg.data.task == "grpo":
        return score_prompts(args, request, cfg)
    with open_session(args, request) as session:
        from ..data import build_datasets
        data = build_datasets(cfg.data, session.tokenizer, cfg.train.seed)  # collective: verified on every rank
        runner = session.runner
        cap = args.eval_sequences or (max(len(s) for s in data.eval) if args.data else cfg.train.eval_sequences)
        eval_set = EvalSet({s.sources[0].name: s for s in data.eval}, cap, batch_size(args, cfg), runner.replica,
                           runner.replicas)
        sequences = sum(eval_set.size(s) for s in data.eval)
        say_what_is_evaluated(eval_set, data.eval, cfg.data.seq_len, "pairs" if preference else "sequences")
        if preference:
            report = score_preferences(args, request, session, cfg, reference, eval_set)
            report.update(pairs=sequences, reference=reference.described)
        else:
            result = evaluate_set(lambda batch, counts: runner.module(**forward_inputs(runner.module, batch)).loss,
                                  eval_set, runner.device)
            report = {"eval_loss": result["eval_loss"], "eval_ppl": result["eval_ppl"],
                      "tokens": result["eval_tokens"], "sequences": sequences,
                      **{k: v for k, v in result.items() if k.startswith("eval_loss/")}}
        report.update(model=session.source.described, data=[s.sources[0].origin for s in data.eval])
        write_report(args, report)
    return 0


def score_prompts(args, request: Request, cfg: Config) -> int:
    """data.task=grpo: one greedy completion per eval prompt (all of --data), scored by the config's grpo.rewards
    (the run's own, or --set grpo.rewards=[...]): reward/mean, reward/<name>, accuracy, completion_length."""
    from ..train.rl.objective import evaluate_prompts
    from ..train.rl.prompts import build_prompt_data
    with open_session(args, request) as session:
        data = build_prompt_data(cfg, session.tokenizer)
        records = data.eval[:args.eval_sequences] if args.eval_sequences else data.eval
        runner = session.runner
        share = (runner.replica, runner.replicas) if runner.mode == "replicas" else (0, 1)
        if ranks.rank() == 0:
            print(f"evaluate: {len(records)} prompt(s), one greedy completion each, rewards "
                  f"{', '.join(r.name for r in cfg.grpo.rewards)}", file=sys.stderr)
        report = evaluate_prompts(runner.module, session.tokenizer, records, cfg, runner.device, share=share)
        report.update(model=session.source.described, data=cfg.data.eval_source or cfg.data.source)
        write_report(args, report)
    return 0


def write_report(args, report: dict) -> None:
    """Rank 0 writes the report as one JSON line, to -o (atomically) or stdout."""
    if ranks.rank() != 0:
        return
    if args.output:
        write_text_atomic(args.output, json.dumps(report) + "\n")
    else:
        sys.stdout.write(json.dumps(report) + "\n")


def say_what_is_evaluated(eval_set: EvalSet, streams: list, seq_len: int, unit: str) -> None:
    """One stderr line per eval split: how many of its sequences (pairs) are scored, and how to score more."""
    if ranks.rank() != 0:
        return
    for stream in streams:
        used, available = eval_set.size(stream), len(stream)
        more = (f"; --eval-sequences {available} scores all of them" if used < available else "")
        print(f"evaluate: {used} of the {available} {unit} of {stream.sources[0].origin} (data.seq_len {seq_len})"
              f"{more}", file=sys.stderr)


@dataclass
class ReferenceSource:
    """The model preference log-ratios are taken against: `load()` gives it complete on CPU (or, inside
    ZeRO-Inference's integration, partitioned as it loads)."""
    load: Callable[[], Any]
    described: str
    hf_config: Any = None  # its architecture when it is not the evaluated model's


def score_preferences(args, request: Request, session, cfg: Config, reference: ReferenceSource,
                      eval_set: EvalSet) -> dict:
    """Training's preference objective over the eval pairs: eval_loss, eval_rewards/* (and the tokens scored)."""
    from ..train.preference import PreferenceObjective
    runner = session.runner
    placed = start_runner(reference.load, reference.hf_config or request.hf_config, request.tp, request.dtype,
                          args.kernel_inject, request.zero, args.nvme_path)
    objective = PreferenceObjective(runner.module, lambda ids, mask: placed.module(
        input_ids=ids, attention_mask=mask).logits, cfg.preference)
    result = evaluate_set(lambda batch, counts: objective(batch, record=counts), eval_set, runner.device,
                          objective.weight)
    return {"eval_loss": result["eval_loss"], **objective.metrics(runner.device, prefix="eval_"),
            "tokens": result["eval_tokens"], **{k: v for k, v in result.items() if k.startswith("eval_loss/")}}


def reference_source(args, request: Request) -> ReferenceSource:
    """--reference SRC, else the weights the run started from (its saved config's model section)."""
    dtype = DTYPES[request.dtype]
    if args.reference is not None:  # "" too: a named error, not the default reference
        source = resolve_source(args.reference, args.trust_remote_code, "--reference")
        hf_config = architecture(source)
        if hf_config.vocab_size != request.hf_config.vocab_size:  # log-ratios compare the same tokens' probabilities
            raise UserError(f"--reference {args.reference} has a vocabulary of {hf_config.vocab_size} tokens and "
                            f"--model {args.model} one of {request.hf_config.vocab_size}: a reference must share the "
                            f"model's tokenizer (the model it was tuned from)")
        return ReferenceSource(lambda: load_model(source, dtype), f"--reference: {source.described}", hf_config)
    saved = request.source.config
    if saved is None:
        raise UserError(f"--model {args.model} is a plain model without a training config, so the reference its "
                        f"preference log-ratios are taken against is unknown: pass --reference SRC (the model it "
                        f"was tuned from)")
    model = saved.model
    if model.name_or_path:  # LoRA too: its reference is the base with the adapter disabled, i.e. the base
        source = resolve_source(model.name_or_path, args.trust_remote_code)
        return ReferenceSource(lambda: load_model(source, dtype), f"the run's starting weights: {source.described}",
                               architecture(source))
    seed = saved.train.seed

    def seeded_init():
        from transformers import AutoModelForCausalLM

        from ..model import hf_config, init_weights_by_name
        built = AutoModelForCausalLM.from_config(hf_config(model, "sdpa"))
        init_weights_by_name(built, seed, model.init_std, ranks.rank())
        return built.to(dtype).eval()
    return ReferenceSource(seeded_init, f"the run's starting weights: its seeded init (train.seed {seed})")


def data_config(args, source: ModelSource, context: int) -> Config:
    """The config whose data section says what to evaluate: --preset's, else the run's or checkpoint's own;
    --data replaces the data with all of SOURCE. Resolved as `show` and `train` resolve it (the --set items
    through the same rules), for the ranks the config was resolved for."""
    saved = source.config
    without_data = [flag for flag, value in (("--task", args.task), ("--seq-len", args.seq_len)) if value is not None]
    if without_data and not args.data:
        raise UserError(f"{' and '.join(without_data)} say how to read --data SOURCE, and no --data was given: the "
                        f"run's or preset's own data is read as it was trained; drop them, or change it with --set "
                        f"data.seq_len=N")
    if not args.preset and saved is None and not args.data:
        raise UserError(f"--model {args.model} carries no training config (a plain HF model): say what to evaluate "
                        f"with --data SOURCE or --preset NAME")
    if args.preset:
        where, world = str(preset_path(args.preset)), None

        def load(overrides: list[str]) -> Config:
            return with_data(args, load_preset(args.preset, overrides), True, context)
    else:
        from ..presets import apply_overrides, config_from_dict
        base = dataclasses.asdict(saved or plain_model_config())
        where, world = ("the run's config", source.world_size) if saved is not None else ("--set", None)

        def load(overrides: list[str]) -> Config:
            return with_data(args, config_from_dict(apply_overrides(base, overrides), source=where), saved is not None,
                             context)
    cfg = resolved_with_overrides(load, args.set, where, world).config
    if cfg.data.seq_len > context:
        raise UserError(f"data.seq_len={cfg.data.seq_len} is longer than the model's context ({context}); pass "
                        f"--seq-len {context} or less")
    return cfg


def with_data(args, cfg: Config, configured: bool, context: int) -> Config:
    """`cfg` with --data (and --task, --seq-len) as its data: all of SOURCE, evaluated."""
    if not args.data:
        return cfg
    seq_len = args.seq_len or (cfg.data.seq_len if configured else min(2048, context))
    task = args.task or cfg.data.task
    # a run's saved config holds its task's resolved packing choice; on data of another task it is decided again
    cross = cfg.data.cross_document_attention if task == cfg.data.task else None
    data = dataclasses.replace(cfg.data, source=args.data, sources=[], eval_source=args.data, task=task,
                               seq_len=seq_len, cross_document_attention=cross)
    return dataclasses.replace(cfg, data=data)


def plain_model_config() -> Config:
    """What --set items change for a plain HF model, which carries no training config: the defaults, in fp32 (the
    model is evaluated in --dtype, so train.precision asks nothing of the DeepSpeed section the defaults leave
    empty)."""
    cfg = Config()
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision="fp32"))


def batch_size(args, cfg: Config) -> int:
    if args.batch_size:
        return args.batch_size
    micro = cfg.train.micro_batch_size
    return micro if isinstance(micro, int) and micro >= 1 else 8
