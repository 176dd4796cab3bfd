"""modelwright: what mixed precision, accumulation, checkpointing and parallelism buy, measured.

The tree says what lives where: ``train/`` (the training core), ``measure/`` (the framework-neutral instrument),
``record.py`` (the one run record), ``loops/`` (the same job in a plain Accelerate loop), ``study/`` (the sweep),
``planner/`` (the memory, communication and cost model) and ``report/`` (tables, plots, README sections).
"""

from pathlib import Path

#: The project's checkout: configs/, results/ and README.md are read and written relative to it.
REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIGS_DIR = REPO_ROOT / "configs"
