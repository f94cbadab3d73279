"""Secrets stay out of files, wandb and logs: secret-looking keys are redacted, and their values can be read
from the environment (`--set deepspeed.comet.api_key=env:COMET_API_KEY`) instead of the command line,
where `ps`, shell history, the launcher's log and wandb's recorded argv would show them."""
from __future__ import annotations

import os
import re
import sys

import yaml

from .errors import UserError


SECRET_WORDS = ("api_key", "apikey", "password", "passwd", "passphrase", "secret", "credential", "private_key",
                "privatekey")
SECRET_NAMES = ("token", "key", "auth")  # only as a whole word of the key: hf_token, wandb.key; not tokenizer
ENV_PREFIX = "env:"
REDACTED = "<redacted>"
# NAME=value as a shell or an env file writes it: the value of a secret-looking NAME is redacted in printed commands
ENV_ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)


def looks_secret(key) -> bool:
    """A config key or an environment variable name that holds a secret: WANDB_API_KEY, HF_TOKEN,
    AWS_SECRET_ACCESS_KEY, DB_PASSWORD, deepspeed.comet.api_key, accessToken; not TOKENIZERS_PARALLELISM,
    max_new_tokens or NCCL_IB_HCA. Words are split at punctuation and camelCase humps."""
    key = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", str(key)).lower()
    words = re.split(r"[^a-z0-9]+", key)
    return any(word in key for word in SECRET_WORDS) or any(name in words for name in SECRET_NAMES)


def redact(value):
    """Config dicts go to disk and wandb without secrets (keys that look like tokens or API keys)."""
    if isinstance(value, dict):
        return {k: (REDACTED if looks_secret(k) and not _is_env_ref(v) else redact(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value


def redacted_keys(value, path: str = "") -> list[str]:
    """The dotted keys `redact` replaces in `value` (to say which values a written file leaves out)."""
    if isinstance(value, dict):
        found = []
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            found += [where] if looks_secret(key) and not _is_env_ref(item) else redacted_keys(item, where)
        return found
    if isinstance(value, list):
        return [key for i, item in enumerate(value) for key in redacted_keys(item, f"{path}[{i}]")]
    return []


def _is_env_ref(value) -> bool:
    return isinstance(value, str) and value.startswith(ENV_PREFIX)


def redact_override(item: str) -> tuple[str, bool]:
    """(`key=value` with any secret in it redacted, whether it held a literal secret)."""
    key, sep, value = item.partition("=")
    if not sep:
        return item, False
    if looks_secret(key.rsplit(".", 1)[-1]):
        return (item, False) if _is_env_ref(value) or value in ("", "null") else (f"{key}={REDACTED}", True)
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        return item, False
    cleaned = redact(parsed)
    if cleaned == parsed:
        return item, False
    return f"{key}={yaml.safe_dump(cleaned, default_flow_style=True).strip()}", True


def redact_argv(argv: list[str]) -> list[str]:
    """A command line with the secrets in its `--set key=value` items and its `NAME=value` environment
    assignments (HF_TOKEN=...) replaced by <redacted>."""
    out, after_set = [], False
    for item in argv:
        if item.startswith("--set="):
            out.append("--set=" + redact_override(item[len("--set="):])[0])
        elif after_set:
            out.append(redact_override(item)[0])
        else:
            out.append(redact_assignment(item))
        after_set = item == "--set"
    return out


def redact_assignment(word: str) -> str:
    """`NAME=value` with the value redacted when NAME looks secret; any other word as it is."""
    match = ENV_ASSIGNMENT.match(word)
    return f"{match.group(1)}={REDACTED}" if match and looks_secret(match.group(1)) else word


def warn_about_literal_secrets(overrides: list[str]) -> None:
    for item in overrides:
        if redact_override(item)[1]:
            key = item.partition("=")[0]
            print(f"warning: --set {key}=... puts a secret on the command line, where ps, shell history, the "
                  f"launcher's log and wandb can see it; give the secret key as {ENV_PREFIX}VARIABLE (e.g. --set "
                  f"deepspeed.comet.api_key={ENV_PREFIX}COMET_API_KEY) and export VARIABLE instead", file=sys.stderr)


def resolve_env_refs(node, path: str = "") -> None:
    """Replace `env:NAME` values of secret-looking keys with the environment variable NAME (in place)."""
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        where = f"{path}.{key}" if path else str(key)
        if _is_env_ref(value) and looks_secret(key):
            name = value[len(ENV_PREFIX):]
            if name not in os.environ:
                raise UserError(f"{where}: {value!r} names the environment variable {name}, which is not set; "
                                f"export {name}=... before launching")
            node[key] = os.environ[name]
        else:
            resolve_env_refs(value, where)
