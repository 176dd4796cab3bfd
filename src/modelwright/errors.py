"""Errors that are the user's to fix: reported as one line naming the key or file, never as a traceback."""

import argparse
import re


class ConfigError(ValueError):
    """A configuration value, file or combination that cannot run; the message names the key or path."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _chain(err: BaseException) -> list[BaseException]:
    """``err`` and the errors it was raised from, outermost first."""
    chain: list[BaseException] = []
    while err is not None and err not in chain:
        chain.append(err)
        err = err.__cause__ or err.__context__
    return chain


def _key_path(texts: list[str]) -> str | None:
    """The dotted key a nested parse error is about, as a user writes it: ``model.network.init_args.width``
    (a section's own arguments need no ``init_args``; a class nested in one, such as the network, does)."""
    keys: list[str] = []
    for text in texts:
        for key in re.findall(r'Parser key "([^"]+)"|Option \'([^\']+)\' is not accepted', text):
            name = key[0] or key[1]
            if name not in keys:
                keys.append(name)
    if not keys:
        return None
    return ".".join(keys[:2] + [f"init_args.{name}" for name in keys[2:]])


def _reason(texts: list[str]) -> str:
    """The innermost error's own words, without jsonargparse's union bookkeeping."""
    noise = ("Does not validate", "Subtypes:", "Errors:", "Given value", "Expected a <class 'NoneType'>",
             "Problem with given class_path", "Parser key", "Expected a path but")
    for text in reversed(texts):
        lines = [line.strip(" -") for line in text.splitlines() if line.strip(" -")]
        meaningful = [line for line in lines if not line.startswith(noise)]
        if meaningful:
            return meaningful[0].rstrip(":")
    return texts[-1].strip()


def one_line(err: BaseException) -> str:
    """The one line a user sees: jsonargparse's multi-line parse error (and the errors it was raised from)
    condensed to ``key: problem; valid: ...``."""
    text = str(err)
    match = None
    if isinstance(err, argparse.ArgumentError):
        match = re.match(r'Parser key "([^"]+)":\s*(.*)', text, re.S)
    if not match:
        return " ".join(text.split())
    key, body = match.groups()
    texts = [str(link) for link in _chain(err)]
    nested = "class_path" in text  # a class given by class path, or one of its arguments
    if nested:
        key = _key_path(texts) or key
    given = re.findall(r"(?:Given|Got) value:\s*(.+)", body)
    choices = max(re.findall(r"Literal\[([^\]]*)\]", body), key=len, default=None)
    if given and choices:
        valid = choices.replace("'", "")
        value = given[-1].strip()
        nested_value = re.fullmatch(r"NestedArg\(key='[^']*', val='(.*)'\)", value)  # --model.x on the line
        return f"{key}: invalid value {nested_value.group(1) if nested_value else value!r}; valid: {valid}"
    if nested:
        return f"{key}: {' '.join(_reason(texts).split())}"
    # a union's refusal lists each member's; None's ("Expected a <class 'NoneType'>") says nothing
    members = re.findall(r"^\s*- (.+)$", body, re.M)
    reasons = [reason.strip() for reason in members if "NoneType" not in reason]
    if given and reasons:
        return f"{key}: invalid value {given[0].strip()!r} ({'; '.join(reasons)})"
    first_line = body.strip().splitlines()[0].strip()
    return f"{key}: {first_line}"
