"""Messages that state their own fix. DeepSpeed's and transformers' config checks say what to change - "set
these DeepSpeed config values to 'auto'", `<"zero_force_ds_cpu_optimizer": false>`, "please set X" - and name
the keys. The doctor reads the instruction and the keys out of the exception message, maps each key onto the
preset's DeepSpeed config (`deepspeed.<path>` overrides the trainer checks by resolving them), and proposes
the change the message asks for; when the preset already says so, the log came from a config of its own and
the doctor quotes the instruction with the key.

ZeRO-Offload with a client optimizer is the one message whose own last resort is not the first thing to do:
its cheapest fix is DeepSpeed's CPU optimizer, not switching the check off.
"""
from __future__ import annotations

import re
from typing import Optional

from ... import ds as dsc
from ..findings import Diagnosis, Found, Proposal
from ..logtext import EXCEPTION, Log

INSTRUCTION = re.compile(r"((?:please|you (?:can|should|must|need to|may)(?!'t|’t|n't| ?not\b)(?: also)?|try(?:ing)?|consider|make sure|"
                         r"ensure)\b[^.\n]*|\bset (?:these|it|them|the|this|\S+ (?:to|=))\b[^.\n]*|\buse \S+[^.\n]* "
                         r"instead\b[^.\n]*|(?:pip|conda) install \S+[^.\n]*|did you mean [^?\n]*\?|[^.\n]*\b(?:must|"
                         r"should|needs? to) be (?:set to|enabled|disabled|true|false)\b[^.\n]*)", re.IGNORECASE)
BOILERPLATE = re.compile(r"(report (this|a|the) bug|file an issue|open an issue|CUDA_LAUNCH_BLOCKING|TORCH_USE_CUDA_DSA|"
                         r"NCCL_DEBUG=INFO for details|look up to see its traceback|max_split_size_mb|"
                         r"expandable_segments|documentation for Memory Management)", re.IGNORECASE)
RUN_WORDS = re.compile(r"\b(run|command|execute|type)\b", re.IGNORECASE)
# an instruction that only shows more ("to get more information") asks for a look, not for a change
INFORMATION = re.compile(r"(to get more (?:information|info|details)|for more (?:information|details|info)|to (?:debug|"
                         r"diagnose|investigate)\b|to see (?:the|what|why|which)\b)", re.IGNORECASE)
MISMATCH_LINE = re.compile(r"^\s*-\s*ds (\S+)=(\S+) vs hf (.+?)=(\S+)\s*$")
QUOTED_SETTING = re.compile(r"<?\"([\w.]+)\":\s*(\"[^\"]*\"|[\w.+-]+)>?")
SET_TO = re.compile(r"\bset (?:`|')?([\w.]+)(?:`|')? (?:to|=) ['\"`]?([\w.+-]+)", re.IGNORECASE)
TO_AUTO = re.compile(r"set these DeepSpeed config values to 'auto'", re.IGNORECASE)
CONCRETE = re.compile(r"(['\"`<]|=|\binstall\b|\bto \S+$)")
EXCEPTION_PREFIX = re.compile(r"^(?:\[rank\d+\]:\s*)?(?:[\w.]+\.)?\w*(?:Error|Exception):\s*")
MESSAGE_LINES = 8
# A message that lists several possible causes states no one remedy ("caused by one of the following reasons:
# 1) ... 2) ...", "possible causes", "this may be because"): acting on its first suggestion is a guess.
SEVERAL_CAUSES = re.compile(r"(one of the following (?:reasons|causes)|(?:several|multiple|possible|potential) (?:reasons|"
                            r"causes)|this (?:may|might|could) be (?:because|due to|caused by)|(?:^|\s)\(?1\)[^\n]*?"
                            r"(?:^|\s)\(?2\))", re.IGNORECASE | re.MULTILINE)
# A message that names versions ("the detected CUDA version (12.2) mismatches the version ... (11.3)") is about the
# environment: which package, which build or pin - the version and toolkit classes' reasoning, not a config key.
VERSIONED = re.compile(r"(\bversions?\b[^.\n]{0,80}?\(?v?\d+\.\d+|\d+\.\d+\)?[^.\n]{0,80}?\bversions?\b)", re.IGNORECASE)
INSTALLS = re.compile(r"\b(?:pip|conda) install\b", re.IGNORECASE)
# A remedy written as code in backticks: `tokenizer.pad_token = tokenizer.eos_token`, `model.enable_input_require_grads()`
CODE = re.compile(r"`([^`\n]*(?:\w\.\w+\s*=\s*[^`\n]+|\w\([^`\n]*\))[^`\n]*)`")


def message_at(log: Log, index: int) -> str:
    """The exception message starting at `index`, with the lines that continue it (wrapped text, a list)."""
    lines = [log.line(index)]
    for line in log.lines[index + 1:index + MESSAGE_LINES]:
        if not line.strip() and lines[-1].rstrip().endswith(":"):
            continue  # "run the following command:", a blank line, the command: the message goes on
        if not line.strip() or EXCEPTION.search(line) or line.lstrip().startswith(("File ", "Traceback", "[20")):
            break
        lines.append(line.strip())
    return "\n".join(lines)


def instructions(message: str) -> list[str]:
    """The message's instructions, the most concrete first (one that names a value, a key or a command), in
    order otherwise: "set these values to 'auto'" before "please correct the following"."""
    found = [EXCEPTION_PREFIX.sub("", m.group(0).strip()) + _introduced(message, m) for m in INSTRUCTION.finditer(message)
             if not BOILERPLATE.search(m.group(0))]
    return sorted(found, key=lambda text: not CONCRETE.search(text))


def _introduced(message: str, m: re.Match) -> str:
    """The command an instruction introduces with a colon ("run the following command:" then `python -m x` on the
    next line): the instruction means nothing without it."""
    if not m.group(0).rstrip().endswith(":") or not RUN_WORDS.search(m.group(0)):
        return ""  # "correct the following values:" introduces a list, read by named_settings
    following = next((line.strip() for line in message[m.end():].split("\n")[1:] if line.strip()), "")
    return f" {following}" if following else ""


def find_message(log: Log) -> Optional[int]:
    """The last exception whose message tells the reader what to change; without an exception line (a message
    pasted alone), the line that opens a list of mismatching settings."""
    index = log.last(EXCEPTION)
    if index is None:
        listed = log.first(MISMATCH_LINE)
        if listed is None:
            return None
        return listed - 1 if listed > 0 and log.lines[listed - 1].strip() else listed  # the list's heading
    message = message_at(log, index)
    if any(MISMATCH_LINE.match(m) for m in message.split("\n")):
        return index
    return index if instructions(message) and states_one_remedy(message) else None


def states_one_remedy(message: str) -> bool:
    """The message states one remedy: not a list of possible causes, and not about versions of the environment
    (unless it names the install command itself)."""
    if SEVERAL_CAUSES.search(message):
        return False
    return not (VERSIONED.search(message) and not INSTALLS.search(message))


VALUE_AFTER = re.compile(r"^\W{0,3}\s*(?:\w+\s+){0,6}?(?:be )?(?:set )?(?:to|=|:)\s*['\"`]?(true|false|auto|none|null|"
                         r"-?[\d.]+(?:e-?\d+)?)\b", re.IGNORECASE)


def named_keys(message: str, paths: dict) -> list[tuple[str, object]]:
    """Keys of the preset's DeepSpeed config the message names - as written (contiguous_gradients) or in words
    ("Contiguous Gradients") - with the value it asks for when one follows ("must be set to True")."""
    found, lowered = [], message.lower()
    for path in paths:
        leaf = path.rsplit(".", 1)[-1]
        if "_" not in leaf:
            continue  # one-word keys (stage, enabled, type) are ordinary words in a message
        for form in (leaf, leaf.replace("_", " ")):
            at = lowered.find(form.lower())
            if at >= 0:
                value = VALUE_AFTER.search(message[at + len(form):at + len(form) + 60])
                found.append((path, _value(value.group(1)) if value else None))
                break
    return found


def named_settings(message: str, paths: Optional[dict] = None) -> list[tuple[str, object]]:
    """(key, value) pairs the message asks for - written as settings, or keys of `paths` (the preset's DeepSpeed
    config) named in the text; the value is None when it names a key without one."""
    found: list[tuple[str, object]] = []
    for line in message.split("\n"):
        if (m := MISMATCH_LINE.match(line)):
            found.append((m.group(1), "auto" if TO_AUTO.search(message) else None))
    for m in QUOTED_SETTING.finditer(message):
        found.append((m.group(1), _value(m.group(2))))
    for m in SET_TO.finditer(message):
        if m.group(1).lower() not in ("these", "it", "them", "the", "this"):
            found.append((m.group(1), _value(m.group(2))))
    named = {key.rsplit(".", 1)[-1] for key, _ in found}
    return found + [(path, value) for path, value in named_keys(message, paths or {})
                    if path.rsplit(".", 1)[-1] not in named]


def _value(text: str) -> object:
    text = text.strip("\"'")
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    try:
        return int(text) if re.fullmatch(r"-?\d+", text) else float(text) if re.fullmatch(r"-?[\d.]+(e-?\d+)?", text) \
            else text
    except ValueError:
        return text


def diagnose_message(f: Found) -> Diagnosis:
    message = message_at(f.log, f.index)
    asked = instructions(message) or ["set these DeepSpeed config values to 'auto'"]
    settings = named_settings(message, dsc.leaf_paths(f.resolved.ds))
    d = Diagnosis("config_message", f"the error says what to change: {asked[0]}", f.line)
    keys = [key for key, _ in settings]
    overrides, unchanged = _overrides(f, settings)
    what = f" ({', '.join(keys)})" if keys else ""
    if overrides:
        d.proposal = Proposal(f"do what the message asks{what}", overrides,
                              f"{asked[0]}: these overrides set it in the preset's DeepSpeed config")
    else:
        code = CODE.search(asked[0]) or CODE.search(message)
        paths = dsc.leaf_paths(f.resolved.ds)
        if any(p == k or p.endswith(f".{k}") for k in keys for p in paths) or (keys and not code):
            where = ("the message names the change; make it where the value comes from (your DeepSpeed JSON, the "
                     "training arguments or the launch command)")
        elif code:
            where = f"the message states the remedy as code: `{code.group(1).strip()}` in the script, before the call that raised"
        elif INSTALLS.search(asked[0]):
            where = "the message states the command to run, in the environment that runs the ranks"
        elif INFORMATION.search(asked[0]):
            d.title = f"the error asks for a look before any change: {asked[0]}"
            d.proposal = Proposal(f"first run what the message asks, to see the cause: {asked[0]}{what}", [],
                                  "the message states no remedy, only how to see the cause: run it in the "
                                  "environment that runs the ranks and read what it reports")
            return d
        else:
            where = "the message states this one remedy"
        d.proposal = Proposal(f"do what the message asks: {asked[0]}{what}", [], where)
    if unchanged:
        d.advice.append(f"preset {f.resolved.config.name} already has {', '.join(unchanged)} as asked, or does not set "
                        f"it: this log came from a config of its own. The trainer fills 'auto' DeepSpeed values from "
                        f"its train.* settings itself (`python -m trainer show PRESET` prints the result)")
    return d


def _overrides(f: Found, settings: list[tuple[str, object]]) -> tuple[list[str], list[str]]:
    """Overrides for the named keys the preset's DeepSpeed config has, that resolve and change something."""
    paths = dsc.leaf_paths(f.resolved.ds)
    overrides, unchanged = [], []
    for key, value in settings:
        path = next((p for p in paths if p == key or p.endswith(f".{key}")), None)
        if path is None or value is None or paths[path] == value:
            unchanged.append(key)
            continue
        override = dsc.set_override(path, value)
        resolved = f.resolves(overrides + [override])
        if resolved is None or dsc.leaf_paths(resolved.ds).get(path) == paths[path]:
            unchanged.append(key)  # it resolves to what the preset has already (an 'auto' the trainer fills)
            continue
        overrides.append(override)
    return overrides, unchanged


# --- ZeRO-Offload with a client optimizer ---------------------------------------------------------------------

CLIENT_OPTIMIZER = re.compile(r"ZeRO-Offload with a client provided optimizer(?: \(<class '([\w.]+))?")
GPU_ONLY = re.compile(r"(apex|bitsandbytes|bnb|fused|8bit|Fused)", re.IGNORECASE)


def diagnose_client_optimizer(f: Found) -> Diagnosis:
    match = next(iter(f.log.all(CLIENT_OPTIMIZER)), None)
    name = match.group(1) if match and match.group(1) else "a client optimizer"
    d = Diagnosis("offload_optimizer", f"ZeRO-Offload with an optimizer DeepSpeed did not build ({name})", f.line)
    if f.facts.configured("zero_force_ds_cpu_optimizer") in ("false", "0", "no"):
        return _opt_out_not_read(f, d)
    d.proposal = Proposal("let DeepSpeed run the optimizer on the CPU: DeepSpeedCPUAdam (the config's optimizer block)",
                          [], "with the optimizer offloaded, the step runs on the CPU: DeepSpeed's DeepSpeedCPUAdam "
                          "(built from an `optimizer` block in the DeepSpeed config, or passed as "
                          "deepspeed.ops.adam.DeepSpeedCPUAdam) is 5-7x faster there than torch's. With the HF Trainer, "
                          "drop the custom optimizer (optimizers=(None, None)) and keep the config's block; this "
                          "trainer's presets always let DeepSpeed build it")
    if GPU_ONLY.search(name):
        d.advice.append(f"{name} is a GPU kernel: it cannot step CPU-resident states at all, so "
                        f"zero_force_ds_cpu_optimizer=false would only move the failure")
    else:
        d.then.append(Proposal("or keep the optimizer and accept the slow CPU step",
                               [dsc.client_optimizer_on_cpu_override()],
                               "zero_force_ds_cpu_optimizer=false lets ZeRO-Offload step a torch optimizer on the CPU "
                               "(DeepSpeed >= 0.8.3 refuses it by default for its speed)"))
    return d


def _opt_out_not_read(f: Found, d: Diagnosis) -> Diagnosis:
    """The log's config already says zero_force_ds_cpu_optimizer: false and DeepSpeed still refused: the setting
    never reached DeepSpeed's config (a launcher's own config section that forwards only the keys it knows, as
    accelerate's `deepspeed_config:` does), so proposing it again is proposing what was tried."""
    d.proposal = Proposal("pin deepspeed==0.8.2, the last release before this check, or give DeepSpeed the opt-out "
                          "in its own config file", [],
                          "the log's config already sets zero_force_ds_cpu_optimizer: false, yet DeepSpeed refused "
                          "the client optimizer: the key did not reach DeepSpeed's config. A launcher's own section "
                          "(accelerate's `deepspeed_config:`) forwards only the keys it knows; put the key in a "
                          "DeepSpeed JSON that the launcher passes whole (accelerate: deepspeed_config_file), or "
                          "use DeepSpeed 0.8.2, which predates the check (added in 0.8.3)")
    d.then.append(Proposal("or let DeepSpeed build the optimizer: DeepSpeedCPUAdam from an `optimizer` block", [],
                           "with the optimizer offloaded, DeepSpeedCPUAdam steps the CPU-resident states 5-7x faster "
                           "than torch's optimizer, and no opt-out is needed"))
    return d


# --- a tokenizer without a padding token ----------------------------------------------------------------------

NO_PAD_TOKEN = re.compile(r"(tokenizer does not have a padding token|Cannot handle batch sizes > 1 if no padding token is "
                          r"defined|Using pad_token, but it is not set yet|pad_token_id (?:is|was) (?:not set|None)|"
                          r"tokenizer\.pad_token (?:is|was) None)", re.IGNORECASE)


def diagnose_pad_token(f: Found) -> Diagnosis:
    d = Diagnosis("pad_token", "the tokenizer has no padding token (batches of several sequences need one)", f.line)
    d.proposal = Proposal("give the tokenizer a pad token: `tokenizer.pad_token = tokenizer.eos_token`", [],
                          "Llama/GPT-2-style tokenizers ship without a pad token; padding a batch (and a model config "
                          "asked for pad_token_id) needs one. Set it after loading the tokenizer and before the "
                          "trainer or collator is built (also `model.config.pad_token_id = tokenizer.pad_token_id`); "
                          "or add a new one with `tokenizer.add_special_tokens({'pad_token': '[PAD]'})` and "
                          "`model.resize_token_embeddings(len(tokenizer))`. This trainer's data preparation sets it "
                          "the first way")
    return d
