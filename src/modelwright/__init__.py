"""modelwright: what mixed precision, accumulation, checkpointing and parallelism buy, measured (README.md: layout)."""

from pathlib import Path

from modelwright.errors import ConfigError

#: The project's checkout: configs/, results/ and README.md are read and written relative to it.
REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIGS_DIR = REPO_ROOT / "configs"


def resolve_config_args(argv: list[str]) -> list[str]:
    """``argv`` with each ``--config`` value a readable YAML file (``--config amp`` is ``configs/amp.yaml``), or a
    one-line error naming it and, for invalid YAML, its line (jsonargparse's own message names neither)."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg in ("--config", "-c") and i + 1 < len(out):
            out[i + 1] = str(_config_file(out[i + 1]))
        elif arg.startswith("--config="):
            out[i] = f"--config={_config_file(arg.split('=', 1)[1])}"
    return out


def _config_file(value: str) -> Path:
    import yaml

    path = next((p for p in (Path(value), CONFIGS_DIR / value, CONFIGS_DIR / f"{value}.yaml") if p.is_file()), None)
    if path is None:
        names = sorted(p.relative_to(CONFIGS_DIR).as_posix() for p in CONFIGS_DIR.rglob("*.yaml"))
        raise ConfigError(f"config: no file {value!r} here or in configs/; available: {', '.join(names)}")
    try:
        yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        line = f" line {err.problem_mark.line + 1}" if getattr(err, "problem_mark", None) else ""
        raise ConfigError(f"config: {path}:{line} is not valid YAML ({getattr(err, 'problem', None) or err})") from None
    except OSError as err:
        raise ConfigError(f"config: cannot read {path} ({err.strerror})") from None
    return path
