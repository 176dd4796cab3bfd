"""modelwright: what mixed precision, accumulation, checkpointing and parallelism buy, measured.

The tree says what lives where: ``train/`` (the training core), ``measure/`` (the framework-neutral instrument),
``record.py`` (the one run record), ``loops/`` (the same job in a plain Accelerate loop), ``study/`` (the sweep),
``planner/`` (the memory, communication and cost model) and ``report/`` (tables, plots, README sections).
"""

from pathlib import Path

from modelwright.errors import ConfigError

#: The project's checkout: configs/, results/ and README.md are read and written relative to it.
REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIGS_DIR = REPO_ROOT / "configs"


def resolve_config_args(argv: list[str]) -> list[str]:
    """``argv`` with each ``--config`` value made a readable YAML file, or a one-line error naming it.

    A bare name resolves to ``configs/<name>`` or ``configs/<name>.yaml`` (``--config amp`` is ``configs/amp.yaml``);
    a file that is not valid YAML is named with its line (jsonargparse's own message does not name it).
    """
    import yaml

    out = list(argv)
    for i, arg in enumerate(out):
        if arg in ("--config", "-c") and i + 1 < len(out):
            out[i + 1] = str(_config_file(out[i + 1]))
        elif arg.startswith("--config="):
            out[i] = f"--config={_config_file(arg.split('=', 1)[1])}"
    for flag, value in zip(out, out[1:], strict=False):
        if flag not in ("--config", "-c"):
            continue
        try:
            yaml.safe_load(Path(value).read_text())
        except yaml.YAMLError as err:
            where = getattr(err, "problem_mark", None)
            line = f" line {where.line + 1}" if where is not None else ""
            problem = getattr(err, "problem", None) or err
            raise ConfigError(f"config: {value}:{line} is not valid YAML ({problem})") from None
        except OSError as err:
            raise ConfigError(f"config: cannot read {value} ({err.strerror})") from None
    return out


def _config_file(value: str) -> Path:
    for candidate in (Path(value), CONFIGS_DIR / value, CONFIGS_DIR / f"{value}.yaml"):
        if candidate.is_file():
            return candidate
    names = sorted(p.relative_to(CONFIGS_DIR).as_posix() for p in CONFIGS_DIR.rglob("*.yaml"))
    raise ConfigError(f"config: no file {value!r} here or in configs/; available: {', '.join(names)}")
