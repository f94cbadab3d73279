"""Reward functions of data.task=grpo (grpo.rewards): built-in verifiable rewards, and a user's own by import path.

Every reward is called as TRL calls its reward functions, with keyword arguments, and returns one float per completion:

    fn(prompts=[...], completions=[...], answer=[...], completion_lengths=[...]) -> list[float]

Built-ins:
    exact_match     1.0 when the completion's answer equals the record's `answer`, else 0.0. The completion's answer
                    is the last \\boxed{...}, else the text after the last "####", else the last number in it;
                    numbers compare as numbers (1,000 = 1000.0), anything else as stripped text.
    format          1.0 when the whole completion matches `pattern` (re.fullmatch, DOTALL), else 0.0; without a
                    pattern, when exact_match finds an answer in it at all.
    length_penalty  0 up to `target_tokens` completion tokens, then -1/target_tokens per extra token, down to -1.

A user's own function is named 'package.module:function': it is imported (the module's code runs) and called in the
training ranks, by the user's choice (docs/security.md). The name is checked when the config is resolved.
"""
from __future__ import annotations

import importlib
import math
import re
from dataclasses import dataclass
from typing import Callable, Optional

from ...config import RewardSpec
from ...errors import UserError
from ...rules import reward_problems as spec_problems

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


class RewardError(UserError):
    """A reward function that cannot be named, imported or called, or that returned something other than floats."""


def extract_answer(text: str) -> Optional[str]:
    """The answer a math-style completion gives: the last \\boxed{}, else what follows the last '####', else the last
    number; None when there is none."""
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return tail.split("\n", 1)[0].strip() or None
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _as_number(text: str) -> Optional[float]:
    try:
        value = float(text.replace(",", "").strip())
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def same_answer(given: Optional[str], expected) -> bool:
    if given is None:
        return False
    expected = str(expected).strip()
    if "####" in expected or "\\boxed{" in expected:  # a worked solution (GSM8K): its final answer
        expected = extract_answer(expected) or expected
    a, b = _as_number(given), _as_number(expected)
    if a is not None and b is not None:
        return a == b
    return given.strip() == expected


def exact_match(completions: list[str], answer: list, **_) -> list[float]:
    return [1.0 if same_answer(extract_answer(c), a) else 0.0 for c, a in zip(completions, answer)]


def format_reward(pattern: Optional[str]) -> Callable:
    compiled = re.compile(pattern, re.DOTALL) if pattern else None

    def format(completions: list[str], **_) -> list[float]:  # noqa: A001 - the reward's name in metrics
        if compiled is None:
            return [1.0 if extract_answer(c) is not None else 0.0 for c in completions]
        return [1.0 if compiled.fullmatch(c) else 0.0 for c in completions]
    return format


def length_penalty(target_tokens: int) -> Callable:
    def penalty(completion_lengths: list[int], **_) -> list[float]:
        return [-min(1.0, max(0, n - target_tokens) / target_tokens) for n in completion_lengths]
    return penalty


@dataclass
class Reward:
    name: str          # as metrics name it: reward/<name>
    weight: float
    fn: Callable


def import_function(path: str, key: str) -> Callable:
    """The function named 'package.module:function' (its module is imported: its code runs)."""
    module_name, _, attribute = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - any failure of the user's module is reported as theirs
        raise RewardError(f"{key}: cannot import module {module_name!r} ({type(err).__name__}: {err}); put it on "
                          f"PYTHONPATH or in the working directory, or fix the name") from None
    fn = getattr(module, attribute, None)
    if not callable(fn):
        raise RewardError(f"{key}: module {module_name!r} has no function {attribute!r}"
                          + (f" ({attribute!r} is a {type(fn).__name__})" if fn is not None else "")
                          + "; name a function fn(prompts, completions, **kwargs) -> list[float]")
    return fn


def build_rewards(specs: list[RewardSpec]) -> list[Reward]:
    out = []
    for index, spec in enumerate(specs):
        problems = spec_problems(spec, index)
        if problems:
            raise RewardError("; ".join(problems))
        if spec.name == "exact_match":
            fn = exact_match
        elif spec.name == "format":
            fn = format_reward(spec.pattern)
        elif spec.name == "length_penalty":
            fn = length_penalty(spec.target_tokens)
        else:
            fn = import_function(spec.name, f"grpo.rewards[{index}].name")
        name = spec.name.rsplit(":", 1)[-1]
        out.append(Reward(name, spec.weight, fn))
    return out


def score(rewards: list[Reward], prompts: list[str], completions: list[str], answers: list,
          lengths: list[int]) -> list[list[float]]:
    """(rewards, completions) values: each function called once on every completion."""
    table = []
    for reward in rewards:
        try:
            values = reward.fn(prompts=prompts, completions=completions, answer=answers, completion_lengths=lengths)
        except RewardError:
            raise
        except Exception as err:  # noqa: BLE001 - a user's function failing is named, with its type
            raise RewardError(f"reward {reward.name!r} raised {type(err).__name__}: {err}") from err
        values = list(values) if values is not None else []
        if len(values) != len(completions):
            raise RewardError(f"reward {reward.name!r} returned {len(values)} value(s) for {len(completions)} "
                              f"completions: return one float per completion")
        try:
            floats = [float(v) for v in values]
        except (TypeError, ValueError):
            raise RewardError(f"reward {reward.name!r} returned {values[:3]!r}...: return floats") from None
        if not all(math.isfinite(v) for v in floats):
            raise RewardError(f"reward {reward.name!r} returned a non-finite value: return finite floats")
        table.append(floats)
    return table
