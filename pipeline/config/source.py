"""The config file as a document: read, parsed as YAML, ``${env:...}`` expanded, and its
secrets remembered for redaction. What the values mean is decided later, by type."""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import unquote

import yaml

from pipeline.config.decode import join
from pipeline.errors import ConfigError
from pipeline.log import is_secret_key, remember_secret

_ENV_RE = re.compile(r"\$\$|\$\{env:([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def read_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text: {err.reason} at byte {err.start}") from None


def parse(text: str, source: str, env: dict[str, str] | None,
          problems: list[str]) -> dict[Any, Any]:
    """The top-level mapping, with ``${env:...}`` expanded (``env``; default: the process
    environment). Text that is not a YAML mapping raises ``ConfigError`` at once: nothing
    else can be checked then. An unset variable is recorded in ``problems``."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}: not valid YAML: {err}") from None
    except RecursionError:  # "[[[[...", deeper than the parser's stack
        raise ConfigError(f"{source}: not valid YAML: nested too deeply") from None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, "
                          f"got {type(doc).__name__}")
    expanded: dict[Any, Any] = _expand(doc, "", dict(os.environ) if env is None else env,
                                       problems)
    _remember_secrets(expanded)
    return expanded


def _expand(node: Any, path: str, env: dict[str, str], problems: list[str]) -> Any:
    """Expand ``${env:NAME}`` / ``${env:NAME:-default}`` in every string value (and the keys
    of a ``tokens:`` mapping); ``$$`` is a ``$``.

    A value that is one reference as a whole stays a string unless it reads as a YAML list
    or mapping; the typed decoding (``decode``, not strict) then turns
    ``port: ${env:PORT}`` into an int where the field is one, while a password ``123456``,
    ``true`` or ``#x`` stays the string it is (re-read as YAML, those became an int, a bool
    and nothing).
    """
    if isinstance(node, dict):
        # an auth extension's inline tokens are the keys of its ``tokens:`` mapping
        keys_too = path.rsplit(".", 1)[-1] == "tokens"
        return {(_expand(k, join(path, k), env, problems) if keys_too else k):
                _expand(v, join(path, k), env, problems) for k, v in node.items()}
    if isinstance(node, list):
        return [_expand(v, f"{path}[{i}]", env, problems) for i, v in enumerate(node)]
    if not isinstance(node, str) or "$" not in node:
        return node

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, default = m.group(1), m.group(2)
        if name in env:
            return env[name]
        if default is not None:
            return default
        problems.append(f"{path}: environment variable {name} is not set and has no default")
        return ""

    whole = _ENV_RE.fullmatch(node)
    out = _ENV_RE.sub(sub, node)
    if whole and whole.group(0) != "$$" and out[:1] in ("[", "{"):
        try:
            parsed = yaml.safe_load(out)
        except yaml.YAMLError:
            return out
        return parsed if isinstance(parsed, list | dict) else out
    return out


def _remember_secrets(node: Any, key: object = None) -> None:
    """Every value under a secret-looking key, and every URL password, is redacted from
    errors and logs from now on (``pipeline.log.redact``)."""
    if isinstance(node, dict):
        if key == "tokens":  # an auth extension's inline tokens are the mapping's keys
            for k in node:
                remember_secret(str(k))
        for k, v in node.items():
            _remember_secrets(v, k)
    elif isinstance(node, list):
        for v in node:
            _remember_secrets(v, key)
    elif isinstance(node, str | int) and not isinstance(node, bool):
        if is_secret_key(key):
            remember_secret(str(node))
        elif isinstance(node, str) and "@" in node:
            m = re.search(r"://[^/@:\s]*:([^/@\s]+)@", node)
            if m:  # as written, and as the client is given it (percent-decoded)
                remember_secret(m.group(1))
                remember_secret(unquote(m.group(1)))
