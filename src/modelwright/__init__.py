"""modelwright: what mixed precision, accumulation, checkpointing and parallelism buy, measured (README.md:
layout)."""

from pathlib import Path

from modelwright.errors import ConfigError

#: The project's checkout: configs/, results/ and README.md are read and written relative to it.
REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIGS_DIR = REPO_ROOT / "configs"


def repo_path(path: str | Path) -> Path:
    """``path`` as given when it exists or is absolute, else the same path under the repository root."""
    path = Path(path)
    if path.exists() or path.is_absolute():
        return path
    return REPO_ROOT / path


def resolve_config_args(argv: list[str]) -> list[str]:
    """``argv`` with each ``--config`` value a readable YAML file (``--config amp`` is ``configs/amp.yaml``),
    or a one-line error naming it and, for invalid YAML, its line (jsonargparse's own message names
    neither)."""
    resolved = list(argv)
    for index, arg in enumerate(resolved):
        if arg in ("--config", "-c") and index + 1 < len(resolved):
            resolved[index + 1] = str(_config_file(resolved[index + 1]))
        elif arg.startswith("--config="):
            value = arg.split("=", 1)[1]
            resolved[index] = f"--config={_config_file(value)}"
    return resolved


def _config_file(value: str) -> Path:
    import yaml

    candidates = (Path(value), CONFIGS_DIR / value, CONFIGS_DIR / f"{value}.yaml")
    path = next((candidate for candidate in candidates if candidate.is_file()), None)
    if path is None:
        names = sorted(found.relative_to(CONFIGS_DIR).as_posix() for found in CONFIGS_DIR.rglob("*.yaml"))
        raise ConfigError(f"config: no file {value!r} here or in configs/; available: {', '.join(names)}")
    try:
        yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        problem = getattr(err, "problem", None) or err
        raise ConfigError(f"config: {path}:{line} is not valid YAML ({problem})") from None
    except OSError as err:
        raise ConfigError(f"config: cannot read {path} ({err.strerror})") from None
    return path
