"""The profile of one plain fp32 step (``measure.profile``), read into typed objects for the memory model.

``profile.json`` (or a record's ``profile`` section) lists, per module in forward order, what MemTracker saw
at its backward peak; the storages autograd saved, each charged to the first unit that saved it; and the
checkpoint segments by granularity. A storage is ``[owner, bytes, kind, dtype]`` in profiles of version 1 and
``{"owner": ..., "bytes": ..., "kind": ..., "dtype": ...}`` from version 2 on; both read the same.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from modelwright.errors import require


class Storage(NamedTuple):
    """A storage autograd saved for backward in the profiled step.

    ``kind``: ``batch`` (grows with the batch), ``fixed`` (per channel), ``param`` (a parameter saved as it
    is), ``cast`` (a weight autocast would copy to 16 bits), ``input`` (the batch itself)."""

    owner: int
    bytes: int
    kind: str
    dtype: str


@dataclass(frozen=True)
class BackwardPeak:
    """Bytes MemTracker counted at a unit's peak in backward."""

    gradients: float
    activations: float
    temporaries: float


@dataclass(frozen=True)
class Unit:
    """A leaf module (or the loss), in forward order; ``segments``: its segment index per granularity."""

    name: str
    type: str
    segments: Mapping[str, int | None]
    width: int | None = None
    backward: BackwardPeak | None = None


@dataclass(frozen=True)
class Segment:
    """A checkpoint segment: its input (bytes, kind, the unit whose saved storage it is) and its
    parameters."""

    input_bytes: int
    input_kind: str
    input_owner: int | None
    param_bytes: int


@dataclass(frozen=True)
class StepProfile:
    batch_size: int
    parameters: int
    largest_param_bytes: int
    units: tuple[Unit, ...]
    storages: tuple[Storage, ...]
    segments: Mapping[str, tuple[Segment, ...]]
    peak_bytes: Mapping[str, float]

    def segments_of(self, granularity: str) -> tuple[Segment, ...]:
        return self.segments.get(granularity, ())


def read_storage(entry: Any) -> Storage:
    """A storage from a version-1 list ``[owner, bytes, kind, dtype]`` or a version-2 object."""
    if isinstance(entry, Mapping):
        return Storage(entry["owner"], entry["bytes"], entry["kind"], entry["dtype"])
    return Storage(*entry)


def read_unit(entry: Mapping) -> Unit:
    backward = entry.get("backward")
    peak = None
    if backward:
        peak = BackwardPeak(backward["gradients"], backward["activations"], backward["temporaries"])
    return Unit(name=entry["name"], type=entry["type"], segments=dict(entry["segments"]),
                width=entry.get("width"), backward=peak)


def read_segment(entry: Mapping) -> Segment:
    return Segment(entry["input_bytes"], entry["input_kind"], entry["input_owner"], entry["param_bytes"])


def read_profile(profile_record: Mapping) -> StepProfile:
    """The typed profile of a record holding a ``profile`` section, or of the section itself."""
    profile = profile_record.get("profile", profile_record)
    require(isinstance(profile, Mapping) and "units" in profile,
            "profile_record: has no 'profile' (profile a baseline step)")
    segments = {granularity: tuple(read_segment(segment) for segment in entries)
                for granularity, entries in profile["segments"].items()}
    return StepProfile(
        batch_size=profile["batch_size"],
        parameters=profile["parameters"],
        largest_param_bytes=profile["largest_param_bytes"],
        units=tuple(read_unit(unit) for unit in profile["units"]),
        storages=tuple(read_storage(storage) for storage in profile["storages"]),
        segments=segments,
        peak_bytes=dict(profile["peak_bytes"]),
    )
