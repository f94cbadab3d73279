"""Messages that state their own fix by naming keys, flags, values or versions - read as statements, not matched
as phrases:

- a conflict, "X cannot be A when B" (`--mixed_precision cannot be fp16 when bf16 is set`): the setting whose
  values include A and B (the trainer schema's choices, the preset's DeepSpeed keys) is set to what B says;
- an unknown key, pydantic's "extra fields not permitted" / "Extra inputs are not permitted" under a key, or
  "unexpected keyword argument 'k'": a key the installed DeepSpeed knows (its learned keys) means the run's
  DeepSpeed is older than the key (the pin); a key no DeepSpeed model has is a misspelling (the nearest key);
- a requirement, "requires torch>=2.5", "needs transformers 4.46 or later": the pin, with the version the log
  shows;
- an expectation, "expected K to be V, got W" naming a key of the config: `--set K=V`;
- an unsupported choice, "your setup doesn't support bf16": the setting whose choices hold it (the schema's
  Literal fields) set to its next choice that resolves for the preset;
- a setting named in words, "the valid values for the number of generations are: [7]" or "Target modules [...]
  not found": the words are a key's name (num_generations, target_modules) in the schema or DeepSpeed's learned
  keys; the valid value it lists is proposed, else the key is named for the user to set.

The keys are looked up in the project's own indexes (the preset's resolved DeepSpeed config, DeepSpeed's learned
pydantic models, the trainer's config schema), so a key is proposed under the path the trainer accepts.
"""
from __future__ import annotations

import difflib
import re
from typing import Optional

from ... import ds as dsc
from ..advice import TRAINER_DEEPSPEED
from ..findings import Diagnosis, Found, Proposal
from ..logtext import Log
from ..raised import Raised, final_exception
from .settings import deepspeed_fields, deepspeed_path_of, deepspeed_sections, sections_with, feature_names, model_targets, named_key, schema_fields, setting_named, spelt

_NAME = r"(?:--?[\w-]+|`[\w.-]+`|'[\w.-]+'|\"[\w.-]+\"|[A-Za-z_][\w.]*)"
CONFLICT = re.compile(rf"(?P<key>{_NAME})\s*(?:=\s*\S+\s+)?(?:cannot|can't|can not|must not|should not|may not|is not "
                      rf"allowed to|is incompatible with being) be (?:set to |used as |)['\"`]?(?P<value>[\w.-]+)['\"`]?"
                      rf",? (?:when|if|while|because|since|as long as|with) (?P<other>[^.;\n]+)", re.IGNORECASE)
QUOTES = "`'\""
PARTICIPLES = {"used", "set", "specified", "enabled", "combined", "passed", "given", "provided", "true", "on"}
EXTRA = re.compile(r"(extra fields not permitted|Extra inputs are not permitted|extra_forbidden)", re.IGNORECASE)
MODEL = re.compile(r"validation errors? for (\w+)")
UNEXPECTED = re.compile(r"unexpected keyword argument '(\w+)'")
PACKAGE = r"(?P<pkg>torch|pytorch|transformers|accelerate|deepspeed|peft|trl|datasets|bitsandbytes|flash[_-]attn|" \
          r"triton|numpy|safetensors|tokenizers|huggingface[_-]hub|liger[_-]kernel|pydantic)"
REQUIREMENT = re.compile(rf"`?{PACKAGE}`?\s*(?:version\s*)?(?P<op>>=|==|~=|<=|>|<)\s*v?(?P<ver>\d+(?:\.\d+)*)",
                         re.IGNORECASE)
LATER = re.compile(rf"{PACKAGE}\s*(?:version\s*)?v?(?P<ver>\d+\.\d+(?:\.\d+)?)\s*(?:or|and) (?:later|higher|newer|"
                   rf"above)|(?:at least|minimum(?: version)?(?: of)?)\s*{PACKAGE.replace('pkg', 'pkg2')}\s*"
                   rf"(?:version\s*)?v?(?P<ver2>\d+\.\d+(?:\.\d+)?)", re.IGNORECASE)
REQUIRE_WORDS = re.compile(r"(requir|need|install|upgrade|at least|minimum|or later|or higher|supported|compatible)",
                           re.IGNORECASE)
FOUND_VERSION = re.compile(r"(?:found|but|have|installed|got|current(?:ly)?|detected|you are using)\s+(?:version\s+)?"
                           r"(?:\w+\s*(?:==|version:?)?\s*)?v?(\d+\.\d+[\w.+]*)", re.IGNORECASE)
EXPECTED = re.compile(r"expected\s+(?:the\s+)?[`'\"]?(?P<key>[\w.-]+)[`'\"]?\s+(?:to be|to equal|==?|of|as)\s+"
                      r"[`'\"]?(?P<want>[\w.-]+)[`'\"]?,?\s*(?:but\s+)?(?:got|found|received|is|was)\s+[`'\"]?"
                      r"(?P<got>[\w.-]+)", re.IGNORECASE)
UNSUPPORTED = re.compile(r"(?:doesn't|does not|do not|don't|can ?not|can't) support (?P<value>[\w.-]+)|"
                         r"(?P<value2>[\w.-]+) (?:is|are) not supported", re.IGNORECASE)
# the complement: "FlashAttention only support fp16 and bf16 data type", "only supports bf16 or fp32"
ONLY = re.compile(r"only (?:supports?|works? with|accepts?|allows?|handles?) (?P<values>[\w.-]+(?:\s*(?:,|/|\band\b|\bor\b)"
                  r"\s*[\w.-]+)*)", re.IGNORECASE)
VALID_VALUES = re.compile(r"valid values? (?:for|of) (?:the )?(?P<phrase>[\w ]{3,60}?) (?:are|is)[: ]+\[(?P<values>[^\]]*)\]",
                          re.IGNORECASE)
NAMED_BAD = re.compile(r"(?P<phrase>[A-Za-z][A-Za-z ]{2,40}?)\s*(?P<value>\(?\s*(?:\[(?:[^\[\]]|\[[^\]]*\])*\]|\{[^}]*\}|'[^']*'|\"[^\"]*\")"
                       r"\s*,?\s*\)?)\s*(?:(?:is|are|were|was) (?:not found|invalid|not supported|unknown|"
                       r"not recogni[sz]ed)|not found)", re.IGNORECASE)
# a printed value that is a container inside a container: `(['q_proj', 'v_proj'],)`, `[['q_proj']]`, `(['q_proj'])`
NESTED = re.compile(r"^\(\s*[\[{]|^\[\s*[\[{(]|,\s*\)$")
# "X only makes sense with ZeRO Stage 3", "can only be used when gradient accumulation steps is 1": the setting
# and the value the message requires
REQUIRED = re.compile(r"(?:only (?:makes sense|works|is valid|is possible|is supported|is allowed)|can only be used|is "
                      r"only available|must be used) (?:with|when|for|if|under|on|in) (?:a |an |the )?(?P<phrase>"
                      r"[A-Za-z][A-Za-z ]{2,40}?)\s*(?:=|==|:|is|of|set to)?\s*(?P<value>\d+|true|false)\b",
                      re.IGNORECASE)
# pydantic's "1 validation error for M / field / Input should be a valid integer, ... [type=int_from_float,
# input_value=15099494.4, ...]": the key, the type it wants and the value it was given
FIELD_TYPE = re.compile(r"validation errors? for (?P<model>\w+)\s*\n\s*(?P<field>\w+)\s*\n\s*Input should be "
                        r"(?P<want>[^\[\n]+?)\s*\[type=(?P<type>\w+),\s*input_value=(?P<value>'[^']*'|[^,\]]+)")
PIP_NAMES = {"pytorch": "torch", "flash_attn": "flash-attn", "huggingface_hub": "huggingface-hub",
             "liger_kernel": "liger-kernel"}


def find(log: Log) -> Optional[int]:
    raised = final_exception(log)
    return raised.index if raised is not None and _statement(raised) else None


def stated_text(raised: Raised) -> str:
    """The final exception's message, then the messages of the exceptions it was raised from (a wrapper's
    "Failed to import X because of the following error" carries the statement in its cause). A log cut before
    its exception line (it ends in frames) has no message: the raising line's own words stand in for it - its
    string literals, which hold what it would have said (`require_version("transformers>=4.36.2", "To fix: pip
    install transformers>=4.36.2")`, `raise ValueError("... cannot be ... when ...")`) - never its code."""
    message = raised.message or _raising_line_words(raised)
    return "\n".join([f"{raised.type}: {message}"] + [f"{kind}: {message}" for kind, message in raised.chain])


LITERAL = re.compile(r"""[rbuf]{0,2}(?:"((?:[^"\\]|\\.)*)"|'((?:[^'\\]|\\.)*)')""")


CALLEE = re.compile(r"([A-Za-z_]\w*)\s*\(")


def _raising_line_words(raised: Raised) -> str:
    """The line's string literals, the names it calls in words (`require_version` -> "require version") and its
    comment."""
    code = (raised.site.code if raised.site else "") or ""
    literals = [a or b for a, b in LITERAL.findall(code) if (a or b).strip()]
    rest = LITERAL.sub(" ", code)
    comment = rest.split("#", 1)[1].strip() if "#" in rest else ""
    callees = [name.replace("_", " ") for name in CALLEE.findall(rest.split("#", 1)[0])]
    return " ".join([*literals, *callees, comment]).strip()


def _statement(raised: Raised) -> Optional[str]:
    text = stated_text(raised)
    if EXTRA.search(text) or UNEXPECTED.search(text):
        return "unknown_key"
    if (m := FIELD_TYPE.search(text)) and deepspeed_path_of(m.group("model"), m.group("field")):
        return "field_type"
    if CONFLICT.search(text):
        return "conflict"
    if _unsupported_choice(text):
        return "unsupported"
    if _only_choices(text):
        return "only"
    if REQUIRE_WORDS.search(text) and (REQUIREMENT.search(text) or LATER.search(text)):
        return "requirement"
    if (m := EXPECTED.search(text)) and _known_key(m.group("key")):
        return "expected"
    if (m := VALID_VALUES.search(text)) and named_key(m.group("phrase")):
        return "valid_values"
    if (m := NAMED_BAD.search(text)) and named_key(m.group("phrase")):
        return "named_setting"
    if (m := REQUIRED.search(text)) and setting_named(m.group("phrase")):
        return "required_value"
    if _refused_feature(text):
        return "refused_feature"
    return None


def diagnose(f: Found) -> Diagnosis:
    raised = final_exception(f.log)
    kind = _statement(raised)
    return {"unknown_key": _unknown_key, "conflict": _conflict, "requirement": _requirement,
            "expected": _expected, "unsupported": _unsupported, "only": _only, "valid_values": _valid_values,
            "named_setting": _named_setting, "refused_feature": _unsupported,
            "required_value": _required, "field_type": _field_type}[kind](f, raised, stated_text(raised))


def _unsupported_choice(text: str) -> Optional[tuple[str, str]]:
    """(schema path, value) for a message saying a value some setting can take is not supported; only choices
    that are not English words (a digit or an underscore in them), so "does not support batch generation" is no
    statement about grpo.scale_rewards."""
    for m in UNSUPPORTED.finditer(text):
        for value in re.split(r"[/,]", (m.group("value") or m.group("value2")).lower()):
            if not re.search(r"[\d_]", value):  # bf16, flash_attention_2; not words ("batch", "group", "none")
                continue
            path = next((p for p, choices in schema_fields().items() if value in choices), None)
            if path:
                return path, value
    return None


def _refused_feature(text: str) -> Optional[tuple[str, str]]:
    """(schema path, value) for the feature a message refuses on this hardware or setup as its subject, by the
    name a library writes it in ("FlashAttention only supports Ampere GPUs or newer", "Liger kernels require a CUDA
    device"): a statement about what the run turned on, not about values a setting lists."""
    for m in FEATURE_REFUSED.finditer(text):
        words = re.findall(r"[A-Za-z0-9]+", m.group("subject"))
        for size in (3, 2, 1):  # the feature is the subject's last words: "the FlashAttention 2 kernel" -> 2-3
            for start in range(max(0, len(words) - size - 1), len(words) - size + 1):
                hit = feature_names().get(spelt("".join(words[start:start + size])))
                if hit:
                    return hit
    return None


# the subject of a refusal: "<feature> only supports / requires / is not supported / is not available ..."
FEATURE_REFUSED = re.compile(r"(?P<subject>[A-Za-z][\w-]*(?:\s+[\w-]+){0,3}?)\s+(?:kernels?\s+)?(?:only supports?\s+(?!"
                             r"(?:fp|bf|float|int|half|the\b|one\b|\w+ (?:and|or) )\w*)|(?:is|are) only supported on|"
                             r"(?:requires?|needs?)\s+(?:an?\s+|the\s+)?(?:CUDA|GPU|NVIDIA|Ampere|Hopper|compute "
                             r"capability|sm_?\d|\w+ GPU|\w+ device)|(?:is|are)(?: currently)? not (?:supported|available)"
                             r" (?:on|with|for|in)\b|(?:is|are)(?: currently)? not available\b|(?:is|are) unavailable)",
                             re.IGNORECASE)
def _only_choices(text: str) -> Optional[tuple[str, list[str]]]:
    """(schema path, the values it names) for a message saying only some values of a setting work ("only support
    fp16 and bf16"): the setting whose choices hold every value named that is not an English word."""
    for m in ONLY.finditer(text):
        values = [v for v in re.split(r"\s*(?:,|/|\band\b|\bor\b)\s*", m.group("values").lower())
                  if re.search(r"[\d_]", v)]
        path = next((p for p, choices in schema_fields().items() if values and set(values) <= set(choices)), None)
        if path:
            return path, values
    return None


def _bare(key: str) -> str:
    return key.strip("`'\"").lstrip("-").replace("-", "_")


def _known_key(key: str) -> bool:
    leaf = _bare(key).rsplit(".", 1)[-1]
    return "_" in leaf and (leaf in deepspeed_fields() or any(p.endswith(f".{leaf}") for p in schema_fields()))


def _ds_path(f: Found, leaf: str) -> Optional[str]:
    return next((p for p in dsc.leaf_paths(f.resolved.ds) if p == leaf or p.endswith(f".{leaf}")), None)


# --- the four statements ------------------------------------------------------------------------------------

def _conflict(f: Found, raised: Raised, text: str) -> Diagnosis:
    m = CONFLICT.search(text)
    key, value, other = _bare(m.group("key")), m.group("value").strip("'\"`"), m.group("other")
    words = [w.strip("`'\"-") for w in re.findall(r"[\w.`'\"-]+", other)]
    if value.lower() in PARTICIPLES:  # "X cannot be used with Y": one of the two goes
        d = Diagnosis("config_message", f"the error states a conflict: {key} cannot be {value} with {other.strip()}",
                      raised.headline)
        d.proposal = Proposal(f"use {m.group('key').strip(QUOTES)} or {other.strip().strip(QUOTES)}, not both", [],
                              "the message names both settings; remove one where the run sets it")
        return d
    d = Diagnosis("config_message", f"the error states a conflict: {key} cannot be {value} when {other.strip()}",
                  raised.headline)
    # the setting whose choices hold both A and what B names is the one the message is about
    for path, choices in schema_fields().items():
        wanted = next((w for w in words if w in choices and w != value), None)
        if value in choices and wanted:
            override = f"{path}={wanted}"
            if str(_current(f, path)) != wanted:
                if f.resolves([override]) is not None:
                    d.proposal = Proposal(f"make {key} agree with {wanted}: {path}={wanted}", [override],
                                          f"the message says {key} cannot be {value} when {other.strip()}; the "
                                          f"trainer's {path} sets both (and DeepSpeed's blocks from it)")
                else:
                    d.proposal = Proposal(f"drop {wanted} where the run sets it ({path}={wanted} does not resolve "
                                          f"for preset {f.resolved.config.name})", [],
                                          f"the message says {key} cannot be {value} when {other.strip()}; this "
                                          f"preset cannot take {wanted}, so the setting that asks for it must go")
                return d
            d.proposal = Proposal(f"set {key} to {wanted} (or drop it) where the run sets it", [],
                                  f"preset {f.resolved.config.name} has {path}={_current(f, path)} already: the "
                                  f"{key}={value} came from the launch command or a config of its own (an accelerate "
                                  f"config, the training arguments); make it {wanted} there")
            return d
    d.proposal = Proposal(f"change {key} from {value}, or undo what it conflicts with ({other.strip()})", [],
                          "the message names both settings; change one where the run sets it")
    return d


def _current(f: Found, path: str):
    section, _, name = path.partition(".")
    node = getattr(f.resolved.config, section, None)
    for part in name.split("."):
        node = getattr(node, part, None)
    return node


CALLEE = re.compile(r"([\w.]+)\(\) got an unexpected keyword argument")


def _unknown_key(f: Found, raised: Raised, text: str) -> Diagnosis:
    keys = _extra_keys(raised.message) or UNEXPECTED.findall(text)
    model = MODEL.search(text)
    where = f" of {model.group(1)}" if model else ""
    known = deepspeed_fields()
    deepspeed_model = model is not None and model.group(1) in set(known.values())
    if not deepspeed_model and not any(k in known for k in keys):
        return _foreign_keys(raised, keys, model.group(1) if model else None, text)
    if model and (misplaced := _misplaced(raised, keys, model.group(1))):
        return misplaced
    d = Diagnosis("config_message", f"the run's DeepSpeed does not know the key{'s' if len(keys) > 1 else ''} "
                                    f"{', '.join(keys)}{where}", raised.headline)
    newer = [k for k in keys if k in known]
    seen = f.versions.get("deepspeed")
    removals = [dsc.set_override(p, None) for k in keys for p in [_ds_path(f, k)] if p]
    if newer:
        d.proposal = Proposal(f"upgrade DeepSpeed to a release that knows {', '.join(newer)}: pip install "
                              f"deepspeed=={TRAINER_DEEPSPEED}",
                              [], f"{', '.join(newer)} {'is' if len(newer) == 1 else 'are'} keys of DeepSpeed "
                              f"{TRAINER_DEEPSPEED} (this trainer's pin; its learned keys hold them)"
                              + (f"; the log's DeepSpeed is {seen}" if seen else "") +
                              ": an older DeepSpeed's pydantic models refuse keys they do not have")
        if removals:
            d.then.append(Proposal("or keep that DeepSpeed and drop the keys", removals,
                                   "null removes a key from the preset's DeepSpeed config"))
        return d
    guesses = {k: difflib.get_close_matches(k, list(known), n=1, cutoff=0.75) for k in keys}
    named = [f"{k} -> {g[0]}" for k, g in guesses.items() if g]
    d.proposal = Proposal("rename the misspelt key" + (f": {', '.join(named)}" if named else "s: no DeepSpeed model "
                          "has them"), removals if not named else [],
                          "no DeepSpeed model has this key (the installed DeepSpeed's learned keys); "
                          + ("the nearest known key is named" if named else "null removes it from the preset"))
    return d


def _misplaced(raised: Raised, keys: list[str], model: str) -> Optional[Diagnosis]:
    """Keys refused by one DeepSpeed section's model that belong to another section (fp16's loss_scale_window under
    bf16): DeepSpeed knows them, so no release fixes it; they are in the wrong place. Older DeepSpeeds ignored
    unknown keys in some sections, so such a config can have worked before an upgrade."""
    section = deepspeed_sections().get(model)
    if section is None:
        return None
    homes = {k: [s for s in sections_with(k) if s != section] for k in keys}
    if not keys or not all(homes.values()) or any(section in sections_with(k) for k in keys):
        return None
    where = "; ".join(f"{k} is a key of {' and '.join(homes[k])}" for k in keys)
    d = Diagnosis("config_message", f"{', '.join(keys)} in the {section} section, whose model ({model}) has no such "
                                    f"key{'s' if len(keys) > 1 else ''}", raised.headline)
    d.proposal = Proposal(f"remove {', '.join(keys)} from the {section} section of the DeepSpeed config", [],
                          f"{where} (the installed DeepSpeed's models), not of {section}: a DeepSpeed whose models forbid "
                          f"extra keys refuses it there (older ones ignored it), so no upgrade fixes this; keep it "
                          f"only where {'it belongs' if len(keys) == 1 else 'they belong'}, and only if that section "
                          f"is on")
    return d


def _foreign_keys(raised: Raised, keys: list[str], model: Optional[str], text: str) -> Diagnosis:
    """Keys refused by something other than DeepSpeed (a TrainingArguments keyword, a tool's config model): the
    code that passes them was written for another version of the code that refuses them."""
    callee = CALLEE.search(text)
    what = model or (callee.group(1) if callee else "the callee")
    package = next((fr.package for fr in reversed(raised.frames) if fr.package), "")
    d = Diagnosis("version", f"{what} does not accept {', '.join(repr(k) for k in keys)}", raised.headline)
    d.proposal = Proposal(f"match the versions: {what}{' (' + package + ')' if package else ''} of the installed "
                          f"release has no {', '.join(keys)}", [],
                          "an argument or key the installed release does not have was renamed, removed, or added "
                          "after it: install the release the script or config was written for (its requirements "
                          "file), or rename the argument to the installed release's name")
    return d


def _extra_keys(message: str) -> list[str]:
    """The keys pydantic names above its "extra fields not permitted" lines (v1 and v2 print the location on the
    line before the error; `a -> b` and `a.b` are nested locations: the leaf is the key)."""
    lines = message.split("\n")
    keys = []
    for i, line in enumerate(lines):
        if EXTRA.search(line) and i > 0:
            location = re.split(r"\s*->\s*|\.", lines[i - 1].strip())[-1]
            if re.fullmatch(r"\w+", location) and location not in keys:
                keys.append(location)
    return keys


def _requirement(f: Found, raised: Raised, text: str) -> Diagnosis:
    m = REQUIREMENT.search(text)
    if m and REQUIRE_WORDS.search(text):
        package, spec = m.group("pkg"), f"{m.group('op')}{m.group('ver')}"
    else:
        later = LATER.search(text)
        package, spec = later.group("pkg") or later.group("pkg2"), f">={later.group('ver') or later.group('ver2')}"
    package = PIP_NAMES.get(package.lower().replace("-", "_"), package.lower())
    found = FOUND_VERSION.search(text[m.end():] if m else text)
    have = found.group(1).rstrip(".") if found else f.versions.get(package)
    d = Diagnosis("version", f"the error states a requirement: {package}{spec}"
                             + (f" (the run has {have})" if have else ""), raised.headline)
    d.proposal = Proposal(f"pin {package}{spec}: pip install '{package}{spec}'", [],
                          f"the message states it needs {package}{spec}" + (f" and the run has {have}" if have else "")
                          + "; install it in the environment the ranks run (every node), or pin the package that "
                          "asks for it to a release that accepts the installed one")
    return d


def _expected(f: Found, raised: Raised, text: str) -> Diagnosis:
    m = EXPECTED.search(text)
    leaf, want = _bare(m.group("key")).rsplit(".", 1)[-1], m.group("want")
    d = Diagnosis("config_message", f"the error states the value it expects: {leaf}={want} (got {m.group('got')})",
                  raised.headline)
    path = _ds_path(f, leaf)
    override = dsc.set_override(path, _scalar(want)) if path else next(
        (f"{p}={want}" for p in schema_fields() if p.endswith(f".{leaf}")), None)
    if override and f.resolves([override]) is not None:
        d.proposal = Proposal(f"set {leaf} to {want}", [override], f"the message expects {leaf}={want}")
    else:
        d.proposal = Proposal(f"set {leaf} to {want} where the run sets it", [],
                              f"the message expects {want} and got {m.group('got')}")
    return d


def _required(f: Found, raised: Raised, text: str) -> Diagnosis:
    m = REQUIRED.search(text)
    path, value = setting_named(m.group("phrase")), m.group("value").lower()
    d = Diagnosis("config_message", f"the error states the setting it requires: {path}={value}", raised.headline)
    override = (dsc.set_override(path.removeprefix("deepspeed."), _scalar(value)) if path.startswith("deepspeed.")
                else f"{path}={value}")
    if f.resolves([override]) is not None:
        d.proposal = Proposal(f"set {path.rsplit('.', 1)[-1]} to {value}", [override],
                              f"the message says {bounded_message(m.group(0))}")
    else:
        d.proposal = Proposal(f"set {path} to {value} where the run sets it (its DeepSpeed config file)", [],
                              f"the message says {bounded_message(m.group(0))}; {override} does not resolve for "
                              f"preset {f.resolved.config.name}")
    return d


# a DeepSpeed config whose "auto" values reached DeepSpeed unfilled: the config in the log, and what comparing the
# string with a number raised (or the user's own words for it)
AUTO_VALUE = re.compile(r"\"(?:train_micro_batch_size_per_gpu|gradient_accumulation_steps|train_batch_size|"
                        r"gradient_clipping|reduce_bucket_size|stage3_\w+|lr|warmup_\w+|total_num_steps)\"\s*:\s*\"auto\"")
AUTO_FAILED = re.compile(r"(between instances of '(?:str' and '(?:int|float)|(?:int|float)' and 'str)'|str(?:ing)? to "
                         r"(?:int|float)|input_value='auto'|'auto'[^\n]{0,80}(?:not|no longer) (?:interpolated|filled|"
                         r"replaced|resolved)|invalid literal for int\(\) with base 10: 'auto')", re.IGNORECASE)


def find_unfilled_auto(log: Log) -> Optional[int]:
    return log.first(AUTO_FAILED) if log.has(AUTO_VALUE) and log.has(AUTO_FAILED) else None


def diagnose_unfilled_auto(f: Found) -> Diagnosis:
    keys = sorted({m.group(0).split('"')[1] for m in f.log.all(AUTO_VALUE)})
    d = Diagnosis("unfilled_auto", f"the DeepSpeed config's \"auto\" values reached DeepSpeed unfilled "
                                   f"({', '.join(keys)})", f.line)
    d.proposal = Proposal(f"replace the \"auto\" values of the DeepSpeed config with explicit numbers: "
                          f"{', '.join(keys)}", [],
                          "\"auto\" is filled by transformers' Trainer (and by accelerate's DeepSpeed plugin in the "
                          "releases that do it for accelerator.prepare); on any other path DeepSpeed compares the "
                          "string with numbers. This trainer writes every value itself (`python -m trainer show "
                          "PRESET` prints them)")
    d.then.append(Proposal("or pin the accelerate/transformers release that filled them for this path", [],
                           "the release notes of the one upgraded last name the change"))
    return d


def _field_type(f: Found, raised: Raised, text: str) -> Diagnosis:
    """A DeepSpeed key given a value of the wrong type. "auto" reaching DeepSpeed means the integration that fills
    "auto" values (transformers' Trainer, accelerate's prepare) did not run or no longer does; a float for an
    integer is a value computed by such an integration (hidden_size * hidden_size * 0.9) without rounding."""
    m = FIELD_TYPE.search(text)
    path, want, given = deepspeed_path_of(m.group("model"), m.group("field")), m.group("want"), m.group("value")
    d = Diagnosis("config_message", f"DeepSpeed's {path} refuses the value {given}: it should be {want}",
                  raised.headline)
    value = _typed(given.strip("'"), m.group("type"))
    callers = sorted({fr.package for fr in raised.frames if fr.package in ("transformers", "accelerate", "trl")})
    filled_by = f" ({' and '.join(callers)} filled it)" if callers else ""
    if given.strip("'") == "auto":
        d.proposal = Proposal(f"replace the \"auto\" values of the DeepSpeed config with explicit numbers ({path} and "
                              f"the others)", [],
                              "only transformers' Trainer (and accelerate's DeepSpeed plugin in the releases that "
                              "fill them) turns \"auto\" into numbers; a config handed to DeepSpeed by another path "
                              "reaches its pydantic models as the string")
        return d
    override = dsc.set_override(path, value) if value is not None else None
    d.proposal = Proposal(f"set {path} to {'an integer' if m.group('type').startswith('int') else want}"
                          + (f": {value}" if value is not None else ""), [override] if override and f.resolves(
                              [override]) is not None else [],
                          f"DeepSpeed's pydantic model {m.group('model')} wants {want} and was given {given}"
                          f"{filled_by}" + ("; a newer release of the library that computed the value casts it "
                                           "(upgrade it) - or set the key yourself" if callers else ""))
    if callers:
        d.then.append(Proposal(f"or upgrade {callers[0]} (pip install -U {callers[0]}), whose computed value DeepSpeed "
                               "refuses", [], "a DeepSpeed release with stricter pydantic models than the integration "
                                              "was written for"))
    return d


def _typed(value: str, kind: str):
    """The value in the type pydantic asked for (int_from_float 15099494.4 -> 15099494); None when it cannot be."""
    try:
        if kind.startswith("int"):
            return int(float(value))
        if kind.startswith("float"):
            return float(value)
        if kind.startswith("bool"):
            return {"true": True, "false": False, "1": True, "0": False}.get(value.lower())
    except ValueError:
        return None
    return None


def _scalar(text: str):
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    return int(text) if re.fullmatch(r"-?\d+", text) else float(text) if re.fullmatch(r"-?\d+\.\d*", text) else text


def _unsupported(f: Found, raised: Raised, text: str) -> Diagnosis:
    path, value = _unsupported_choice(text) or _refused_feature(text)
    d = Diagnosis("config_message", f"the error states that {value if value != 'true' else path} is not supported "
                                    f"here ({path})", raised.headline)
    others = ["false"] if value == "true" else [c for c in schema_fields()[path] if c not in (value, "auto")]
    found = _first_resolving(f, path, others)
    if found:
        choice, overrides = found
        d.proposal = Proposal(f"{path}={choice} instead of {value}", overrides,
                              f"the message says this setup does not support {value}; {choice} is the next "
                              f"choice of {path} the preset resolves with")
        return d
    d.proposal = Proposal(f"change {path} from {value} where the run sets it", [],
                          f"the message says this setup does not support {value}")
    return d


def _only(f: Found, raised: Raised, text: str) -> Diagnosis:
    path, values = _only_choices(text)
    section, field = path.split(".")
    current = str(getattr(getattr(f.resolved.config, section), field))
    d = Diagnosis("config_message", f"the error states that only {' or '.join(values)} work here ({path})",
                  raised.headline)
    if current in values:  # the config already says so: the code that ran used another value than the config's
        what = (f"load the model in {current}: `from_pretrained(..., torch_dtype=torch.{DTYPES[current]})` "
                f"(`dtype=` in transformers >= 4.56)" if path == "train.precision" else
                f"make the code that failed use {path}'s value ({current})")
        d.proposal = Proposal(what, [], f"the message says only {' or '.join(values)} work; this preset already "
                                        f"sets {path}={current}, so what failed was made another way" +
                              (" - a model loaded without a dtype is float32 in transformers"
                               if path == "train.precision" else ""))
        return d
    found = _first_resolving(f, path, values)
    if found:
        value, overrides = found
        d.proposal = Proposal(f"{path}={value} instead of {current}", overrides,
                              f"the message says only {' or '.join(values)} work; {value} is the first of them "
                              f"the preset resolves with")
        return d
    d.proposal = Proposal(f"set {path} to one of {values} where the run sets it", [],
                          f"the message says only {' or '.join(values)} work")
    return d


DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _first_resolving(f: Found, path: str, choices: list[str]) -> Optional[tuple[str, list[str]]]:
    """(choice, overrides) for the first of `choices` the preset resolves with when `path` is set to it (a precision
    brings its DeepSpeed blocks along); None when none does."""
    for choice in choices:
        overrides = [f"{path}={choice}"] + (dsc.precision_overrides(f.resolved.ds, choice)
                                            if path == "train.precision" else [])
        if f.resolves(overrides) is not None:
            return choice, overrides
    return None


def _valid_values(f: Found, raised: Raised, text: str) -> Diagnosis:
    m = VALID_VALUES.search(text)
    path, values = named_key(m.group("phrase")), [v.strip(" '\"") for v in m.group("values").split(",") if v.strip()]
    d = Diagnosis("config_message", f"the error lists the valid values of {path}: {values or 'none'}", raised.headline)
    override = f"{path}={values[0]}" if values else None
    if override and path in schema_fields() and f.resolves([override]) is not None:
        d.proposal = Proposal(f"set {override}", [override], f"the message lists {values} as the valid values of "
                              f"{m.group('phrase').strip()} for this batch")
    else:
        d.proposal = Proposal(f"set {path} to one of {values}" + (f" ({override} where the run sets it)" if override
                                                                  else ", or change what they depend on"), [],
                              f"the message lists the values {m.group('phrase').strip()} can take with the rest of "
                              f"the run's settings" + ("" if not override or path not in schema_fields() else
                                                       f"; {override} does not resolve for preset "
                                                       f"{f.resolved.config.name}: change the batch it depends on"))
    return d


def _named_setting(f: Found, raised: Raised, text: str) -> Diagnosis:
    m = NAMED_BAD.search(text)
    path = named_key(m.group("phrase"))
    d = Diagnosis("config_message", f"the error names a setting whose value is refused: {path}", raised.headline)
    value = m.group("value").strip()
    if NESTED.search(value):  # the names may be right: what was passed is not a flat list of them
        leaf = path.rsplit(".", 1)[-1]
        d.proposal = Proposal(f"make {leaf} a flat list of names: the value printed is a container inside a "
                              f"container, {bounded_message(value, 60)} (a trailing comma after the list makes a "
                              f"tuple holding it)", [],
                              f"the message prints {bounded_message(value, 80)}: one element that is itself a list, "
                              f"which equals no module's name, whatever names it holds. A trailing comma "
                              f"(`targets=[...],`) or a list wrapped in another is the usual cause; pass "
                              f"{leaf}=['q_proj', 'v_proj'] as a plain list (or one string)")
        return d
    if path == "model.lora.target_modules" and (known := model_targets(f)):
        model, targets = known
        override = f"{path}=[{', '.join(targets)}]"
        d.proposal = Proposal(f"target the modules {model} models have: {', '.join(targets)}",
                              [override] if f.resolves([override]) is not None else [],
                              f"the message says {bounded_message(m.group(0))}; PEFT's own table of default targets "
                              f"(peft.utils.constants) names {targets} for the '{model}' family the log loads "
                              f"(`model.named_modules()` lists every name)")
        return d
    d.proposal = Proposal(f"set {path} to what the model or run really has", [],
                          f"the message says the {m.group('phrase').strip()} it was given are not there: "
                          f"{bounded_message(m.group(0))}; list the names the model has and set {path} to them")
    return d


def bounded_message(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"
