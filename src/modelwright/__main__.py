"""To run: ``uv run python -m modelwright <tool> --help``; the tools are listed in :data:`TOOLS`."""

import importlib
import sys

#: tool name → the module whose ``main(argv)`` runs it.
TOOLS = {
    "study": "modelwright.study",
    "report": "modelwright.report",
    "analysis": "modelwright.report.analysis",
    "plan": "modelwright.planner",
    "accelerate": "modelwright.loops.accelerate",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in TOOLS:
        print(f"usage: python -m modelwright {{{','.join(TOOLS)}}} ...", file=sys.stderr)
        return 2
    return importlib.import_module(TOOLS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
