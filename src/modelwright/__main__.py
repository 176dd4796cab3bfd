"""``uv run python -m modelwright <tool> --help``, a tool of :data:`TOOLS`: jsonargparse turns its typed
function into flags and a ``--config`` file. Only the chosen tool's module is imported, so a bad flag is
reported before torch loads where the tool allows. Every tool's arguments are checked before it runs (types
by jsonargparse, the files and folders it names here, the rest by the tool itself first thing); a user's error
is one line on stderr and exit status 2."""

import argparse
import importlib
import inspect
import json
import math
import os
import sys
from collections.abc import Mapping
from typing import Any

from jsonargparse import auto_parser

from modelwright import importable_working_folder, repo_path, resolve_config_args
from modelwright.errors import ConfigError, one_line, require
from modelwright.inputs import require_creatable_folder, require_file, require_folder

#: tool → the module whose function of the tool's name it runs.
TOOLS = {
    "study": "modelwright.study",
    "report": "modelwright.report",
    "plan": "modelwright.planner",
    "accelerate": "modelwright.loops.accelerate",
}
#: What each tool does, for ``python -m modelwright --help`` (which imports none of them).
SUMMARIES = {
    "study": "measure what each technique buys here: a plan of runs, each a fresh process, then the report",
    "report": "rebuild the tables, plots and the generated sections of README.md and docs/ from the records",
    "plan": "what fits a memory budget per device (--budget_gib), or memory, time and cost at N GPUs",
    "accelerate": "the training of main.py fit as a plain Hugging Face Accelerate loop, the same record",
}
#: The files and folders each tool's arguments name, and what each must be: ``file`` to read, ``document`` to
#: read and rewrite, ``folder`` to read, ``output`` a folder to write in (made if missing). The Accelerate
#: loop checks its own (modelwright.train.checks.check_accelerate_run).
PATH_ARGUMENTS = {
    "study": {"plan": "file", "results": "output", "workdir": "output", "readme": "document"},
    "report": {"results": "folder", "readme": "document"},
    "plan": {"record": "file"},
}
#: Relative paths a tool reads from the repository when they are not in the working folder.
_FROM_REPOSITORY = {"plan", "readme"}


#: The tools whose ``--config`` files are a training job's (as ``main.py fit --config`` takes them), not their
#: own arguments: they become the ``job`` argument.
JOB_TOOLS = ("study", "plan")


def job_arguments(argv: list[str]) -> list[str]:
    """``argv`` with each ``--config FILE`` (``--config=FILE``) gathered into one ``--job=[FILE, ...]``; a
    name of ``configs/`` (``--config amp``) is its file there, as for ``main.py fit``."""
    files: list[str] = []
    rest: list[str] = []
    index = 0
    while index < len(argv):
        arg = argv[index]
        if arg in ("--config", "-c") and index + 1 < len(argv):
            files.append(argv[index + 1])
            index += 2
            continue
        if arg.startswith("--config="):
            files.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
        index += 1
    if not files:
        return rest
    resolved = resolve_config_args([part for name in files for part in ("--config", name)])
    return [*rest, "--job=" + json.dumps(resolved[1::2])]


def check_paths(tool: str, arguments: Mapping[str, Any]) -> None:
    """The files and folders ``arguments`` name are of the kind the tool needs, before it touches any."""
    for key, kind in PATH_ARGUMENTS.get(tool, {}).items():
        value = arguments.get(key)
        if value is None:
            continue
        path = repo_path(value) if key in _FROM_REPOSITORY else value
        if kind == "file":
            require_file(key, path)
        elif kind == "document":
            require_file(key, path, writable=True)
        elif kind == "folder":
            require_folder(key, path)
        else:
            require_creatable_folder(key, path)


def _usage(argv: list[str]) -> int:
    asked_for_help = argv[:1] in (["-h"], ["--help"])
    if not asked_for_help:
        given = f": no tool {argv[0]!r}" if argv else ": name a tool"
        print(f"error: python -m modelwright{given}; one of {', '.join(TOOLS)} (--help says what each does)",
              file=sys.stderr)
        return 2
    tools = "\n".join(f"  {name:<11} {summary}" for name, summary in SUMMARIES.items())
    print(f"usage: python -m modelwright <tool> [--help]\n\n{tools}\n\n"
          "python -m modelwright <tool> --help lists a tool's flags.")
    return 0


def _description(function: Any) -> str:
    """A tool's whole docstring up to its ``Args:``: jsonargparse would show its first line alone."""
    text = inspect.getdoc(function) or ""
    return text.split("\nArgs:")[0].strip()


def run_tool(name: str, argv: list[str]) -> Any:
    """Parse ``argv`` for tool ``name``, check what it names, then run it; returns what the tool returns."""
    importable_working_folder()  # a config may name classes in the working folder's files
    module = importlib.import_module(TOOLS[name])
    function = getattr(module, name)
    if name == "accelerate":  # main.py fit's arguments, read by main.py fit's parser
        if argv[:1] in (["-h"], ["--help"]):
            print(module.USAGE)
            return 0
        return function(argv)
    if name in JOB_TOOLS:
        argv = job_arguments(argv)
    argv = resolve_config_args(argv, training=False)
    parser = auto_parser(function, prog=f"python -m modelwright {name}", exit_on_error=False,
                         allow_abbrev=False, description=_description(function))
    parsed = parser.parse_args(argv)
    check_paths(name, parsed)
    arguments = vars(parser.instantiate(parsed))
    arguments.pop("config", None)
    return function(**{key: _plain(key, value) for key, value in arguments.items()})


def _plain(key: str, value: Any) -> Any:
    """A number as a plain ``int`` or ``float``, finite: jsonargparse's ``PositiveInt`` and the like are
    subclasses that ``yaml.safe_dump`` cannot write (a study's run files), and ``1e999`` passes
    ``PositiveFloat``."""
    if isinstance(value, float):
        require(math.isfinite(value), f"{key}: must be a finite number, got {value}")
        return float(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value)
    return value


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in TOOLS:
        return _usage(argv)
    try:
        status = run_tool(argv[0], argv[1:])
    except (ConfigError, argparse.ArgumentError) as err:
        if os.environ.get("MODELWRIGHT_DEBUG") == "1":
            raise
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 2
    except FloatingPointError as err:  # the Accelerate loop's run diverged (its record says so)
        if os.environ.get("MODELWRIGHT_DEBUG") == "1":
            raise
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 1
    if isinstance(status, int):
        return status
    return 0  # the Accelerate loop returns its network and record


if __name__ == "__main__":
    raise SystemExit(main())
