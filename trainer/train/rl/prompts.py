"""GRPO's data: prompt + answer records from JSONL, checked strictly, tokenized once, and dealt per optimizer step.

A record is one JSON object per line: `prompt` (a string, or `messages`: chat messages) and `answer` (a string or a
number: what the rewards check); the field names are data.prompt_field / data.messages_field / data.answer_field.
Every string passes the one text gate (trainer/text.py). A problem names the file, the line and the field, and the
fix. With a chat template (the tokenizer's, or data.chat_template), a prompt is rendered as a user turn with the
generation prompt; without one, the text is continued as it is.

The loader deals prompts by global position like the token loader (trainer/data/loader.py): step s of cycle
c = s // grpo.num_iterations uses the prompts at positions [c x B, (c + 1) x B) of the shuffled stream (B = prompts
per step on every rank; each epoch a new permutation drawn from (seed, epoch)); every iteration of a cycle returns
the same prompts. Its state is (prompts consumed, iteration), so a resume continues at any step.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ... import text as text_gate
from ...data.records import DataError
from ...named_inputs import looks_like_path


@dataclass
class PromptRecord:
    text: str            # the prompt as rendered for the model
    answer: str          # what the rewards check
    ids: list[int]       # tokenized prompt
    origin: str          # FILE:LINE


def read_records(path: str, cfg_data, kind: str = "data.source") -> list[tuple[dict, str]]:
    """(record, "FILE:LINE") of every non-blank line, each a JSON object."""
    file = Path(path).expanduser()
    if not file.exists() and not looks_like_path(path):
        return hub_records(path, cfg_data, kind)
    if not file.is_file():
        raise DataError(f"{kind} {path}: no such file; GRPO reads a JSONL file of {{\"{cfg_data.prompt_field}\": ..., "
                        f"\"{cfg_data.answer_field}\": ...}} records")
    try:
        lines = file.read_text(encoding="utf-8", errors="strict").splitlines()
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start}); save it as UTF-8") from None
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{where}: not valid JSON ({err.msg} at column {err.colno}); each line must be one object "
                            f"like {{\"{cfg_data.prompt_field}\": \"2+3=\", \"{cfg_data.answer_field}\": \"5\"}}") from None
        if not isinstance(record, dict):
            raise DataError(f"{where}: a JSON {type(record).__name__}, expected an object with "
                            f"\"{cfg_data.prompt_field}\" and \"{cfg_data.answer_field}\"")
        out.append((record, where))
    if not out:
        raise DataError(f"{kind} {path}: the file has no records (one JSON object per line with "
                        f"\"{cfg_data.prompt_field}\" and \"{cfg_data.answer_field}\")")
    return out


def hub_records(name: str, cfg_data, kind: str) -> list[tuple[dict, str]]:
    """(record, "NAME[split][row]") of a hub dataset (data.subset, data.split; eval_source with data.eval_split)."""
    from datasets import load_dataset
    split = (cfg_data.eval_split or cfg_data.split) if kind == "data.eval_source" else cfg_data.split
    try:
        rows = load_dataset(name, cfg_data.subset, split=split)
    except Exception as err:  # noqa: BLE001 - the hub's many failures, named with the dataset
        raise DataError(f"{kind} {name}: cannot load the hub dataset ({type(err).__name__}: {str(err)[:300]}); "
                        f"check the name, data.subset and data.split, or give a local JSONL file") from None
    return [(dict(row), f"{name}[{split}][{index}]") for index, row in enumerate(rows)]


def check_record(record: dict, where: str, cfg_data) -> tuple[str | list, str]:
    """(prompt string or chat messages, answer string) of a record, or a DataError naming the field and the fix."""
    p, m, a = cfg_data.prompt_field, cfg_data.messages_field, cfg_data.answer_field
    if isinstance(record.get(p), str):
        prompt = record[p]
        field = p
    elif p not in record and isinstance(record.get(m), list):
        prompt, field = record[m], m
        if not prompt or not all(isinstance(x, dict) and isinstance(x.get("content"), str)
                                 and isinstance(x.get("role"), str) for x in prompt):
            raise DataError(f"{where}: field {m!r} must be a non-empty list of {{\"role\": ..., \"content\": ...}} "
                            f"messages with string values")
    elif p in record:
        raise DataError(f"{where}: field {p!r} is a {type(record[p]).__name__}, expected a string (the prompt)")
    else:
        raise DataError(f"{where}: no field {p!r} (the prompt; or {m!r}: chat messages); found keys "
                        f"{sorted(record)[:8]}: rename the field or set data.prompt_field")
    if isinstance(prompt, str) and not prompt.strip():
        raise DataError(f"{where}: field {p!r} is empty: give every record a prompt")
    if a not in record:
        raise DataError(f"{where}: no field {a!r} (the answer the rewards check); found keys {sorted(record)[:8]}: "
                        f"add it or set data.answer_field")
    answer = record[a]
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise DataError(f"{where}: field {a!r} is a {type(answer).__name__}, expected a string or a number")
    answer = answer if isinstance(answer, str) else json.dumps(answer)
    for name, value in ((field, prompt), (a, answer)):
        message = text_gate.refusal(value, where, name)
        if message:
            raise DataError(message)
    return prompt, answer


def render(tokenizer, prompt) -> str:
    """A prompt as the model sees it: through the chat template (a user turn + generation prompt) when the tokenizer
    has one, else as written (chat messages then need a template)."""
    template = getattr(tokenizer, "chat_template", None)
    if template:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if isinstance(prompt, list):
        raise DataError("chat messages need a chat template and this tokenizer has none: set data.chat_template "
                        "(e.g. chatml) or give plain prompts")
    return prompt


def load_prompts(path: str, tokenizer, cfg_data, max_prompt_tokens: int, kind: str = "data.source"
                 ) -> list[PromptRecord]:
    """Every record of `path`, checked, rendered and tokenized; a prompt longer than `max_prompt_tokens` is cut from
    the left with data.truncate, else an error naming its line."""
    out = []
    for record, where in read_records(path, cfg_data, kind):
        prompt, answer = check_record(record, where, cfg_data)
        try:
            text = render(tokenizer, prompt)
        except DataError as err:
            raise DataError(f"{where}: {err}") from None
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        if len(ids) > max_prompt_tokens:
            if not cfg_data.truncate:
                raise DataError(f"{where}: the prompt is {len(ids)} tokens, more than data.seq_len - "
                                f"grpo.max_new_tokens = {max_prompt_tokens}: raise data.seq_len, lower "
                                f"grpo.max_new_tokens, shorten the prompt or set data.truncate=true (cut from the left)")
            ids = ids[-max_prompt_tokens:]
        if not ids:
            raise DataError(f"{where}: the prompt tokenizes to nothing")
        out.append(PromptRecord(text, answer, ids, where))
    return out


@dataclass
class GrpoData:
    train: list[PromptRecord]
    eval: list[PromptRecord]
    stats: str


def build_prompt_data(cfg, tokenizer) -> GrpoData:
    """The train and eval prompts of data.source (eval: data.eval_source, or data.eval_fraction of the records held
    out by data.split_seed)."""
    d = cfg.data
    limit = d.seq_len - cfg.grpo.max_new_tokens
    if limit < 1:
        raise DataError(f"data.seq_len={d.seq_len} leaves no room for a prompt beside grpo.max_new_tokens="
                        f"{cfg.grpo.max_new_tokens}: raise data.seq_len or lower grpo.max_new_tokens")
    records = load_prompts(d.source, tokenizer, d, limit)
    if d.eval_source:
        train, held = records, load_prompts(d.eval_source, tokenizer, d, limit, "data.eval_source")
    else:
        order = np.random.default_rng(d.split_seed).permutation(len(records))
        count = int(round(len(records) * d.eval_fraction)) if len(records) > 1 else 0
        count = min(max(count, 1 if d.eval_fraction > 0 and len(records) > 1 else 0), len(records) - 1)
        held_ids = set(order[:count].tolist())
        train = [r for i, r in enumerate(records) if i not in held_ids]
        held = [r for i, r in enumerate(records) if i in held_ids]
    lengths = [len(r.ids) for r in train]
    stats = (f"{len(train)} train prompts, {len(held)} eval prompts from {d.source}; prompt tokens "
             f"{min(lengths)}-{max(lengths)}, up to {cfg.grpo.max_new_tokens} new tokens each")
    return GrpoData(train, held, stats)


class PromptLoader:
    """This rank's prompts per micro-batch: {"prompts": (accum, prompts per micro) indices into the train records,
    "micro": k, "iteration": i}; every micro-batch of a step carries the whole step's prompts (the rollout of a
    step is made at its first micro-batch)."""

    def __init__(self, count: int, per_micro: int, accum: int, dp_rank: int, dp_size: int, iterations: int,
                 seed: int):
        if count < 1:
            raise DataError("GRPO needs at least one training prompt")
        self.count, self.per_micro, self.accum, self.dp_rank, self.dp_size = count, per_micro, accum, dp_rank, dp_size
        self.iterations, self.seed = iterations, seed
        self.start, self.first_iteration, self.taken = 0, 0, 0
        self._permutations: dict[int, np.ndarray] = {}

    @property
    def per_step(self) -> int:
        return self.per_micro * self.accum * self.dp_size

    def _position(self, steps: int) -> tuple[int, int]:
        """(prompts consumed before the cycle, iteration in it) after `steps` steps since the load."""
        cycles, iteration = divmod(self.first_iteration + steps, self.iterations)
        return self.start + cycles * self.per_step, iteration

    def state_dict(self) -> dict:
        prompts, iteration = self._position(self.taken // self.accum)
        return {"prompts": prompts, "iteration": iteration}

    def load_state_dict(self, state: dict) -> None:
        if "prompts" not in state or "iteration" not in state:
            raise DataError(f"saved data position {state} is not a GRPO prompt position: resume a checkpoint of a "
                            f"data.task=grpo run")
        self.start, self.first_iteration, self.taken = int(state["prompts"]), int(state["iteration"]), 0

    def prompt_ids(self, positions: np.ndarray) -> np.ndarray:
        epochs, within = np.divmod(positions, self.count)
        out = np.empty_like(positions)
        for epoch in np.unique(epochs).tolist():
            if epoch not in self._permutations:
                self._permutations = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.count)}
            chosen = epochs == epoch
            out[chosen] = self._permutations[epoch][within[chosen]]
        return out

    def __iter__(self):
        while True:
            step, k = divmod(self.taken, self.accum)
            first, iteration = self._position(step)
            positions = np.array([[first + (micro * self.dp_size + self.dp_rank) * self.per_micro + j
                                   for j in range(self.per_micro)] for micro in range(self.accum)], dtype=np.int64)
            self.taken += 1
            yield {"prompts": torch.from_numpy(self.prompt_ids(positions.reshape(-1)).reshape(positions.shape)),
                   "micro": torch.tensor(k), "iteration": torch.tensor(iteration)}


@dataclass
class GrpoEvalSet:
    """The eval prompts, in the shape the loop's first evaluation describes (one 'stream', its size, forwards)."""
    records: list
    micro: int
    dp_size: int

    @property
    def streams(self) -> dict:
        return {"eval": self.records}

    def size(self, stream) -> int:
        return len(stream)

    def forwards(self) -> int:
        return -(-len(self.records) // max(1, self.micro * self.dp_size))
