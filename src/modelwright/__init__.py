"""modelwright: what mixed precision, accumulation, checkpointing and parallelism buy, measured (README.md:
layout)."""

import os
import sys
from pathlib import Path

from modelwright.errors import ConfigError

#: The project's checkout: configs/, results/ and README.md are read and written relative to it.
REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIGS_DIR = REPO_ROOT / "configs"


def importable_working_folder() -> None:
    """Let a config name classes in the working folder's own files (``class_path: my_net.Net``), as ``python
    -m`` does; ``main.py`` puts only its own folder on the path."""
    folder = os.getcwd()
    if folder not in sys.path:
        sys.path.insert(0, folder)


def repo_path(path: str | Path) -> Path:
    """``path`` as given when it exists or is absolute, else the same path under the repository root."""
    path = Path(path)
    if path.exists() or path.is_absolute():
        return path
    return REPO_ROOT / path


def resolve_config_args(argv: list[str], training: bool = True) -> list[str]:
    """``argv`` with each ``--config`` value a readable YAML file, read strictly (a duplicated key, an empty
    file, ``trainer: null``: a one-line error naming the file, and the line where YAML tells it). A training
    config may be named as in ``configs/``: ``--config amp`` is ``configs/amp.yaml``."""
    resolved = list(argv)
    for index, arg in enumerate(resolved):
        if arg in ("--config", "-c") and index + 1 < len(resolved):
            resolved[index + 1] = str(_config_file(resolved[index + 1], training))
        elif arg.startswith("--config="):
            value = arg.split("=", 1)[1]
            resolved[index] = f"--config={_config_file(value, training)}"
    return resolved


def _config_file(value: str, training: bool) -> Path:
    from modelwright.inputs import TRAINING_SECTIONS, read_yaml

    path = Path(value)
    if training and not path.exists():
        candidates = (CONFIGS_DIR / value, CONFIGS_DIR / f"{value}.yaml")
        path = next((candidate for candidate in candidates if candidate.is_file()), path)
    if training and not path.exists():
        names = sorted(found.relative_to(CONFIGS_DIR).as_posix() for found in CONFIGS_DIR.rglob("*.yaml"))
        raise ConfigError(f"config: no file {value!r} here or in configs/; available: {', '.join(names)}")
    read_yaml("config", path, TRAINING_SECTIONS if training else ())
    return path
