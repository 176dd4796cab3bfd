"""``uv run python -m modelwright <tool> --help``, a tool of :data:`TOOLS`: jsonargparse turns its typed
function into flags and a ``--config`` file. Only the chosen tool's module is imported, so a bad flag is
reported before torch loads where the tool allows; a user's error is one line on stderr and exit status 2."""

import argparse
import importlib
import os
import sys

from jsonargparse import CLI

from modelwright import resolve_config_args
from modelwright.errors import ConfigError, one_line

#: tool → the module whose function of the tool's name it runs.
TOOLS = {
    "study": "modelwright.study",
    "report": "modelwright.report",
    "plan": "modelwright.planner",
    "accelerate": "modelwright.loops.accelerate",
}


def _usage(argv: list[str]) -> int:
    given = ""
    if argv and not argv[0].startswith("-"):
        given = f" (got {argv[0]!r})"
    print(f"usage: python -m modelwright {{{','.join(TOOLS)}}} [--help]{given}", file=sys.stderr)
    asked_for_help = argv[:1] in (["-h"], ["--help"])
    return 0 if asked_for_help else 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in TOOLS:
        return _usage(argv)
    name, rest = argv[0], argv[1:]
    module = importlib.import_module(TOOLS[name])
    try:
        if name == "accelerate":  # the training configs: --config amp is configs/amp.yaml, as for main.py
            rest = resolve_config_args(rest)
        # PARSER_KWARGS: e.g. the Accelerate loop's default config file
        status = CLI(getattr(module, name), args=rest, prog=f"python -m modelwright {name}",
                     exit_on_error=False, **getattr(module, "PARSER_KWARGS", {}))
    except (ConfigError, argparse.ArgumentError) as err:
        if os.environ.get("MODELWRIGHT_DEBUG") == "1":
            raise
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 2
    if isinstance(status, int):
        return status
    return 0  # the Accelerate loop returns its network and record


if __name__ == "__main__":
    raise SystemExit(main())
