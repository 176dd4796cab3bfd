"""Errors that are the user's to fix: reported as one line naming the key or file, never as a traceback."""

import argparse
import re


class ConfigError(ValueError):
    """A configuration value, file or combination that cannot run; the message names the key or path."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def one_line(err: BaseException) -> str:
    """The one line a user sees: jsonargparse's multi-line parse error condensed to ``key: problem; valid:
    ...``."""
    text = str(err)
    match = None
    if isinstance(err, argparse.ArgumentError):
        match = re.match(r'Parser key "([^"]+)":\s*(.*)', text, re.S)
    if not match:
        return " ".join(text.split())
    key, body = match.groups()
    given = re.search(r"(?:Given|Got) value:\s*(.+)", body)
    choices = max(re.findall(r"Literal\[([^\]]*)\]", body), key=len, default=None)
    if given and choices:
        valid = choices.replace("'", "")
        return f"{key}: invalid value {given.group(1).strip()!r}; valid: {valid}"
    # a union's refusal lists each member's; None's ("Expected a <class 'NoneType'>") says nothing
    members = re.findall(r"^\s*- (.+)$", body, re.M)
    reasons = [reason.strip() for reason in members if "NoneType" not in reason]
    if given and reasons:
        return f"{key}: invalid value {given.group(1).strip()!r} ({'; '.join(reasons)})"
    first_line = body.strip().splitlines()[0].strip()
    return f"{key}: {first_line}"
