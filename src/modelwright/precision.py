"""Lightning's precision names and what each one means to the rest of the project: the dtype the matmuls run
in, whether autocast runs, and Hugging Face Accelerate's ``mixed_precision``. The one table of them; no torch
here."""

from dataclasses import dataclass

from modelwright.errors import require


@dataclass(frozen=True)
class Precision:
    """One of Lightning's precisions. ``accelerate`` is Accelerate's ``mixed_precision`` (None: it has
    none)."""

    name: str
    compute_dtype: str
    autocast: bool
    accelerate: str | None


_TABLE = (
    Precision("32-true", "float32", autocast=False, accelerate="no"),
    Precision("bf16-mixed", "bfloat16", autocast=True, accelerate="bf16"),
    Precision("16-mixed", "float16", autocast=True, accelerate="fp16"),
    Precision("bf16-true", "bfloat16", autocast=False, accelerate=None),
    Precision("16-true", "float16", autocast=False, accelerate=None),
    Precision("64-true", "float64", autocast=False, accelerate=None),
)
PRECISIONS = {entry.name: entry for entry in _TABLE}
#: The short names Lightning also accepts.
ALIASES = {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed", "64": "64-true"}


def precision(name: object, key: str = "trainer.precision") -> Precision:
    """The :class:`Precision` of ``name`` (a Lightning name or its short form, ``None``: ``32-true``); a
    ConfigError naming ``key`` and the valid names if it is none of them."""
    text = "32-true"
    if name is not None:
        text = str(name).strip().lower()
    text = ALIASES.get(text, text)
    require(text in PRECISIONS, f"{key}: unknown precision {name!r}; valid: {', '.join(PRECISIONS)}")
    return PRECISIONS[text]
