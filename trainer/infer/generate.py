"""`python -m trainer generate`: complete prompts with a trained model, on one rank or under a launcher.

    python -m trainer generate --model runs/tiny_cpu --prompt "Once upon a time" --greedy
    deepspeed --num_gpus 2 --module trainer generate --model runs/tiny_cpu --prompts prompts.jsonl --format jsonl

Rank 0 alone writes results (stdout, or -o FILE); logs go to stderr, so `--format jsonl` output is one JSON object
per prompt: prompt, completion, tokens, time_to_first_token_s, tokens_per_s. Prompts are batched with left
padding (--batch-size); a batched prompt gets the tokens it would get alone. A completion ends at EOS, at the chat
template's end-of-turn token (a chat model's answer), or before a --stop text.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, replace

import torch

from .. import numbers, paths
from ..flag_needs import needs
from .. import ranks
from ..data.prompts import Prompt, completion_ids, encode_left_padded, read_prompts, render
from ..errors import UserError
from ..files import check_target, write_text_atomic
from ..data.chat_format import stop_token_ids
from .runner import Runner
from .session import add_model_arguments, check_arguments, open_session


DEFAULT_MAX_NEW = 64  # --max-new-tokens when not given


@dataclass
class Settings:
    max_new_tokens: int
    sample: bool           # False: greedy
    temperature: float
    top_p: float
    seed: int
    batch_size: int
    chat: bool
    ignore_eos: bool = False  # always generate max_new_tokens (benchmarks: the same work in every contender)
    stop: tuple[str, ...] = ()  # --stop strings: a completion ends before the first one it writes


@dataclass
class Result:
    prompt: str
    completion: str
    tokens: int
    time_to_first_token_s: float
    tokens_per_s: float


def generate_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    given = parser.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    given.add_argument("--prompts", metavar="FILE.jsonl", type=paths.input_file("prompts file"),
                       help='prompts, one JSON object per line: {"prompt": ...} '
                                                               'or {"messages": [...]}')
    parser.add_argument("--max-new-tokens", type=numbers.COUNT, default=None,
                        help=f"tokens to generate at most (default {DEFAULT_MAX_NEW}, or what the model's context "
                             f"leaves after the longest prompt)")
    parser.add_argument("--greedy", action="store_true", help="greedy decoding (the default without --temperature)")
    parser.add_argument("--temperature", type=numbers.TEMPERATURE, help="sample at this temperature (> 0)")
    needs(parser.add_argument("--top-p", type=numbers.PROBABILITY, default=None,
                              help="nucleus sampling mass, with --temperature (default 1.0: all of it)"),
          "--temperature (greedy decoding takes the likeliest token, whatever the nucleus)",
          lambda args: args.temperature is not None)
    needs(parser.add_argument("--seed", type=numbers.SEED, default=None,
                              help="sampling seed (the same on every rank; default 0)"),
          "--temperature (greedy decoding draws nothing)", lambda args: args.temperature is not None)
    parser.add_argument("--num-beams", type=numbers.COUNT, default=1, help="beam search is not supported (DeepSpeed)")
    parser.add_argument("--batch-size", type=numbers.COUNT, default=8, help="prompts per generate call on one rank")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="generate --max-new-tokens even past EOS and the chat template's end of turn")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="end a completion before this text (repeat for several); EOS and the chat template's "
                             "end-of-turn token always end it")
    parser.add_argument("--format", choices=("text", "jsonl"), default="text")
    parser.add_argument("-o", "--output", type=paths.output_file("output file"),
                        help="write the results here instead of stdout (rank 0)")


def settings_from(args) -> Settings:
    if args.num_beams != 1:
        raise UserError(f"--num-beams {args.num_beams}: DeepSpeed's inference engine refuses beam search "
                        f"(generate raises NotImplementedError for num_beams > 1); use greedy or --temperature, or "
                        f"serve the HF export with vLLM/SGLang for beam search")
    if args.greedy and args.temperature is not None:
        raise UserError("--greedy and --temperature: choose one (greedy decoding, or sampling at a temperature)")
    checks = [(all(args.stop), "--stop needs a non-empty text"),
              (args.max_new_tokens is None or args.max_new_tokens >= 1,
               f"--max-new-tokens {args.max_new_tokens} must be >= 1"),
              (args.batch_size >= 1, f"--batch-size {args.batch_size} must be >= 1"),
              (args.temperature is None or args.temperature > 0, f"--temperature {args.temperature} must be > 0 "
                                                                 f"(use --greedy for deterministic decoding)"),
              (args.top_p is None or 0 < args.top_p <= 1, f"--top-p {args.top_p} must be in (0, 1]")]
    for ok, message in checks:
        if not ok:
            raise UserError(message)
    return Settings(args.max_new_tokens or DEFAULT_MAX_NEW, args.temperature is not None, args.temperature or 1.0,
                    1.0 if args.top_p is None else args.top_p,
                    args.seed or 0, args.batch_size, args.chat, args.ignore_eos, tuple(args.stop))


def prompts_from(args) -> list[Prompt]:
    if args.prompts:
        return read_prompts(args.prompts)
    return [Prompt(text, "--prompt") for text in args.prompt]


def generate(args) -> int:
    settings, prompts = settings_from(args), prompts_from(args)
    if args.output:
        check_target(args.output)
    request = check_arguments(args, settings.batch_size)
    texts = [render(request.tokenizer, p, settings.chat) for p in prompts]
    context = int(request.hf_config.max_position_embeddings)
    if args.max_new_tokens is None:
        settings = fit_default_to_context(settings, request.tokenizer, texts, context)
    check_lengths(request.tokenizer, prompts, texts, settings.max_new_tokens, context)
    with open_session(args, request) as session:
        results = generate_all(session.runner, session.tokenizer, prompts, settings)
        if ranks.rank() == 0:
            write_results(results, args.format, args.output)
    return 0


def generate_all(runner: Runner, tokenizer, prompts: list[Prompt], settings: Settings) -> list[Result]:
    """Every prompt's result, in prompt order, on every rank (each replica generates its share)."""
    texts = [render(tokenizer, p, settings.chat) for p in prompts]
    mine = list(range(runner.replica, len(prompts), runner.replicas))
    batches = [mine[i:i + settings.batch_size] for i in range(0, len(mine), settings.batch_size)]
    if runner.synced:  # every ZeRO-Inference rank runs the same number of generate calls (each forward gathers)
        most = -(-len(range(0, len(prompts), runner.replicas)) // settings.batch_size)
        batches += [[]] * (most - len(batches))
    results: dict[int, Result] = {}
    for number, batch in enumerate(batches):
        chosen = batch or [0]  # a filler batch on a rank with no prompts left
        for index, result in zip(chosen, generate_batch(runner, tokenizer, [texts[i] for i in chosen], settings,
                                                        seed=settings.seed + number)):
            if batch:
                results[index] = Result(prompts[index].text, *result)
    return gather_results(results, len(prompts))


def fit_default_to_context(settings: Settings, tokenizer, texts: list[str], context: int) -> Settings:
    """Without --max-new-tokens, a model whose context is short (a tiny preset's 64 positions) generates what its
    context leaves after the longest prompt instead of refusing the default; said on stderr."""
    room = context - max(len(tokenizer(text)["input_ids"]) for text in texts)
    if 1 <= room < settings.max_new_tokens:
        if ranks.rank() == 0:
            print(f"generate: --max-new-tokens {room} (the model's context of {context} less the longest prompt; "
                  f"default {DEFAULT_MAX_NEW})", file=sys.stderr)
        return replace(settings, max_new_tokens=room)
    return settings


def check_lengths(tokenizer, prompts: list[Prompt], texts: list[str], max_new: int, context: int) -> None:
    for prompt, text in zip(prompts, texts):
        length = len(tokenizer(text)["input_ids"])
        if length == 0:
            raise UserError(f"{prompt.origin}: the prompt is empty (no tokens); give some text to continue")
        if length + max_new > context:
            raise UserError(f"{prompt.origin}: the prompt is {length} tokens and --max-new-tokens {max_new} more "
                            f"would pass the model's context of {context} (max_position_embeddings); shorten the "
                            f"prompt or lower --max-new-tokens to {max(context - length, 0)}")


class FirstToken:
    """A transformers streamer that records when the first new token arrived (the first `put` is the prompt)."""

    def __init__(self):
        self.calls, self.first = 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2:
            self.first = time.perf_counter()

    def end(self):
        pass


@torch.no_grad()
def generate_batch(runner: Runner, tokenizer, texts: list[str], settings: Settings, seed: int):
    """(completion, tokens, time to first token, tokens/s) per text of one left-padded batch."""
    batch = {k: v.to(runner.device) for k, v in encode_left_padded(tokenizer, texts).items()}
    sampling = {"do_sample": True, "temperature": settings.temperature, "top_p": settings.top_p} if settings.sample \
        else {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    if settings.ignore_eos:
        sampling["min_new_tokens"] = settings.max_new_tokens
    if settings.stop:
        sampling.update(stop_strings=list(settings.stop), tokenizer=tokenizer)
    stops = stop_token_ids(tokenizer)  # EOS and the chat template's end of turn (trainer/data/chat_format.py)
    torch.manual_seed(seed)  # the same on every rank: tensor-parallel ranks must draw the same tokens
    streamer, started = FirstToken(), time.perf_counter()
    out = runner.module.generate(**batch, max_new_tokens=settings.max_new_tokens, use_cache=True, streamer=streamer,
                                 synced_gpus=runner.synced, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=stops or None, **sampling)
    elapsed = time.perf_counter() - started
    first = (streamer.first or time.perf_counter()) - started
    width = batch["input_ids"].shape[1]
    rows = []
    for row in out[:, width:].cpu():
        ids = completion_ids(row, [] if settings.ignore_eos else stops)
        if settings.stop:  # a row a stop string ended is padded to the batch's end, as after EOS
            ids = without_trailing(ids, tokenizer.pad_token_id)
        text = before_stop(tokenizer.decode(ids, skip_special_tokens=True), settings.stop)
        rows.append((text, len(ids), first, len(ids) / elapsed))
    return rows


def without_trailing(ids: list[int], pad_id: int | None) -> list[int]:
    end = len(ids)
    while end and ids[end - 1] == pad_id:
        end -= 1
    return ids[:end]


def before_stop(text: str, stops: tuple[str, ...]) -> str:
    """The text up to the first --stop string it contains (the stop string itself left out, as EOS is)."""
    cut = min((text.index(s) for s in stops if s in text), default=len(text))
    return text[:cut]


def gather_results(mine: dict[int, Result], count: int) -> list[Result]:
    from ..distributed import comm_device
    from ..train.integrity import all_gather_text
    merged: dict[int, dict] = {}
    for part in all_gather_text(json.dumps({i: asdict(r) for i, r in mine.items()}), comm_device()):
        merged.update({int(i): r for i, r in json.loads(part).items()})
    return [Result(**merged[i]) for i in range(count)]


def write_results(results: list[Result], fmt: str, output: str | None) -> None:
    if fmt == "jsonl":
        text = "".join(json.dumps(asdict(r), ensure_ascii=False) + "\n" for r in results)
    else:
        text = "".join(f"{r.prompt}{r.completion}\n\n" for r in results)
    if output:
        write_text_atomic(output, text)
    else:
        sys.stdout.write(text)
        sys.stdout.flush()
    total = sum(r.tokens for r in results)
    print(f"generated {total} tokens for {len(results)} prompt(s)" + (f"; wrote {output}" if output else ""),
          file=sys.stderr)
