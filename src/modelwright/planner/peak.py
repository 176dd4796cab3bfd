"""One rank's peak tensor memory under a config, predicted from the profile of one plain fp32 step.

The step's backward is replayed moment by moment; each moment is a :class:`PeakPoint` of the gradients,
gathered parameters, activations and temporaries alive then, on top of what the whole step holds (weights,
optimizer state, buffers, DDP's buckets). The profile gives, per unit (leaf module), MemTracker's bytes at
that unit's peak in backward and the tensors it saved. What PyTorch allocates, and when, is stated where it is
applied, one mechanism per comment; none is a constant fitted to a measurement.
"""

import bisect
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from modelwright.errors import require
from modelwright.planner.memory import MIB, StepSetup, state_bytes_per_rank, step_setup
from modelwright.planner.step_profile import BackwardPeak, Segment, StepProfile, Storage, Unit, read_profile

CATEGORIES = ("parameters", "buffers", "gradients", "optimizer_state", "activations", "temporaries",
              "comm_buffers")


class PeakPoint(NamedTuple):
    """The bytes of one moment of the step that change from moment to moment."""

    gradients: float
    parameters: float
    activations: float
    temporaries: float

    @property
    def total(self) -> float:
        return self.gradients + self.parameters + self.activations + self.temporaries


def forward_positions(storages: Sequence[Storage]) -> list[float]:
    """When in forward each storage was saved, in unit indices.

    A module called twice in one forward (the ReLU that ResNet's blocks apply again after the residual add)
    is one unit, at its first call; the storage list is in the order the tensors were saved, so a storage
    listed after a later unit's was saved by the second call, just after that unit (half a unit on)."""
    positions = []
    latest = -1
    for storage in storages:
        positions.append(float(storage.owner) if storage.owner >= latest else latest + 0.5)
        latest = max(latest, storage.owner)
    return positions


def own_moments(units: Sequence[Unit]) -> list[int]:
    """The units whose backward snapshot is a moment of their own, in forward order.

    MemTracker closes a module's backward window only when the gradient of its input is complete, so a
    branch that shares its input with another (ResNet's downsample beside the block's convolutions) stays
    open through the other branch and reports that branch's peak: a snapshot equal to an earlier unit's is
    that unit's."""
    seen: list[BackwardPeak] = []
    moments = []
    for index, unit in enumerate(units):
        if unit.backward is None:
            continue
        if unit.backward not in seen:
            moments.append(index)
        seen.append(unit.backward)
    return moments


class ShardedBlocks:
    """FSDP2 as the study applies it (``fully_shard`` on each block, then on the root), one block at a time in
    backward. Without sharding every figure is 0."""

    def __init__(self, profile: StepProfile, setup: StepSetup) -> None:
        self.setup = setup
        self.blocks = profile.segments_of("block")
        self.unit_blocks = [unit.segments.get("block") for unit in profile.units]
        in_blocks = [index for index, block in enumerate(self.unit_blocks) if block is not None]
        self.first_block_unit = in_blocks[0] if in_blocks else None
        self.root_bytes = profile.parameters * 4 - sum(block.param_bytes for block in self.blocks)
        self.active = setup.shard > 1 and bool(self.blocks)

    def in_stem(self, unit: int) -> bool:
        """Whether ``unit`` runs before every block in forward (after them all in backward)."""
        return self.first_block_unit is not None and unit < self.first_block_unit

    def finished_bytes(self, unit: int) -> int:
        """The parameters of the blocks whose backward is over at ``unit``: those after its own; all of them
        in the stem."""
        block = self.unit_blocks[unit]
        if block is not None:
            return sum(entry.param_bytes for entry in self.blocks[block + 1:])
        return sum(entry.param_bytes for entry in self.blocks) if self.in_stem(unit) else 0

    def gathered_parameters(self, unit: int) -> float:
        """The root's own parameters stay gathered from forward to the end of backward; a block's are
        gathered from its pre-backward to its post-backward."""
        if not self.active:
            return 0.0
        block = self.unit_blocks[unit]
        running = self.blocks[block].param_bytes if block is not None else 0
        return (self.root_bytes + running) * self.setup.state.weights / 4

    def buffers(self, unit: int) -> float:
        """Temporaries beside a block's backward: the all-gather output of the block before it (prefetched at
        this block's pre-backward, copied into that block's parameters only at its own), and the
        reduce-scatter input of the block after it (its whole gradients, flat, kept until the next
        reduce-scatter is issued at the end of this block's backward)."""
        if not self.active:
            return 0.0
        gathered = self.setup.state.weights / 4
        scattered = self.setup.state.gradients / 4
        block = self.unit_blocks[unit]
        if block is None and self.in_stem(unit):  # the stem still holds block 0's reduce-scatter input
            return self.blocks[0].param_bytes * scattered
        if block is None:  # the head waits for the last block, prefetched at the root's pre-backward
            return self.blocks[-1].param_bytes * gathered
        buffers = 0.0
        if block > 0:
            buffers += self.blocks[block - 1].param_bytes * gathered
        if block + 1 < len(self.blocks):
            buffers += self.blocks[block + 1].param_bytes * scattered
        return buffers


class BackwardReplay:
    """The step's backward, unit by unit, rescaled from the profiled fp32 step for a :class:`StepSetup`."""

    def __init__(self, profile: StepProfile, setup: StepSetup) -> None:
        self.profile = profile
        self.setup = setup
        self.segments = profile.segments_of(setup.granularity)
        self.positions = forward_positions(profile.storages)
        self.sharded = ShardedBlocks(profile, setup)
        units = range(len(profile.units))
        self.first_unit = {self.segment_of(unit): unit for unit in reversed(units)}
        self.last_unit = {self.segment_of(unit): unit for unit in units if profile.units[unit].backward}

    def segment_of(self, unit: int | None) -> int | None:
        """The checkpoint segment ``unit`` is in (None: outside every segment, or no checkpointing)."""
        if not self.segments or unit is None:
            return None
        return self.profile.units[unit].segments.get(self.setup.granularity)

    def scaled(self, size: float) -> float:
        """A tensor of the profiled step that grows with the batch, at this step's batch and width."""
        return size * self.setup.batch_ratio / self.setup.narrow

    def storage_bytes(self, storage: Storage) -> float:
        """What a storage saved in the profiled step costs this step."""
        setup = self.setup
        wide = 2 if storage.dtype == "float32" else 1
        if storage.kind == "batch":
            return storage.bytes * setup.batch_ratio / (wide if setup.narrow == 2 else 1)
        if storage.kind == "fixed":
            return storage.bytes / (wide if setup.state.weights == 2 else 1)
        if storage.kind == "cast":  # autocast's 16-bit copy of a weight
            return storage.bytes / 2 if setup.autocast else 0.0
        if storage.kind == "input" and self.profile.units[storage.owner].type:
            return self.batch_copy_bytes(storage.bytes)
        return 0.0  # a parameter saved as it is, or the labels the loss saves

    def batch_copy_bytes(self, size: float) -> float:
        """The copy of the batch the first layer saves; the batch itself costs the step nothing."""
        if self.setup.autocast:  # autocast's 16-bit copy
            return size * self.setup.batch_ratio / 2
        if self.setup.channels_last_copy:
            # With model.channels_last the LightningModule copies each NCHW batch to NHWC before the first
            # layer, and the first convolution saves that copy for its weight gradient.
            return self.scaled(size)
        return 0.0

    def segment_input_bytes(self, segment: Segment) -> float:
        """What the checkpoint keeps of a segment's input until backward reaches the segment."""
        if segment.input_kind == "input":
            return 0.0  # the batch itself
        return self.storage_bytes(Storage(0, segment.input_bytes, segment.input_kind, "float32"))

    def kept_by_module(self, segment: Segment) -> bool:
        """Whether a module outside every segment saves this segment's input anyway."""
        return segment.input_owner is not None and self.segment_of(segment.input_owner) is None

    def activations(self, unit: int, whole_segment: bool = False, released: int | None = None) -> float:
        """Saved tensors alive at ``unit`` in backward: those saved up to it in forward outside checkpointed
        segments and in its own recomputed segment (all of that segment's at its start: ``whole_segment``),
        less what unit ``released`` alone saved; and the inputs the checkpoint keeps of the segments
        started."""
        segment = self.segment_of(unit)
        alive = 0.0
        for storage, position in zip(self.profile.storages, self.positions, strict=True):
            owner_segment = self.segment_of(storage.owner)
            reached = position <= unit or (whole_segment and owner_segment == segment)
            if reached and storage.owner != released and owner_segment in (None, segment):
                alive += self.storage_bytes(storage)
        for index, entry in enumerate(self.segments):
            if self.first_unit.get(index, unit + 1) <= unit and not self.kept_by_module(entry):
                alive += self.segment_input_bytes(entry)
        return alive + self.unprofiled(unit)

    def unprofiled(self, unit: int) -> float:
        """What MemTracker counted as activations at a unit beyond the batch and per-channel tensors the
        profile charged there (outputs autograd holds, views), grown with the batch."""
        stored = zip(self.profile.storages, self.positions, strict=True)
        charged = sum(storage.bytes for storage, position in stored
                      if position <= unit and storage.kind in ("batch", "fixed"))
        return self.scaled(max(0.0, self.profile.units[unit].backward.activations - charged))

    def weight_bytes(self, unit: int) -> int:
        """The fp32 bytes of the weights a unit saved (a layer saves its weight for its input's gradient)."""
        return sum(storage.bytes for storage in self.profile.storages
                   if storage.owner == unit and storage.kind in ("cast", "param"))

    def casts_weights(self, unit: int) -> bool:
        """Whether autocast runs this unit in 16 bits, on a 16-bit copy of its weight."""
        return self.setup.autocast and any(storage.owner == unit and storage.kind == "cast"
                                           for storage in self.profile.storages)

    def output_bytes(self, unit: int) -> int:
        """A layer's output in the profiled step: the first thing the next unit saves (a convolution's
        BatchNorm saves its input, the loss the logits); 0 if the next unit saves none."""
        following = unit + 1
        return next((storage.bytes for storage in self.profile.storages
                     if storage.owner == following and storage.kind == "batch"), 0)

    def temporaries(self, unit: int) -> float:
        """The temporaries at a unit's peak in backward."""
        weight = self.weight_bytes(unit)
        # The layer's backward allocates its weight's gradient at the weight's size whatever the batch (in 16
        # bits where the layer ran in 16 bits); the rest, gradients of activations, grows with the batch.
        width = 0.5 if self.casts_weights(unit) or self.setup.state.weights == 2 else 1.0
        batch_part = max(0.0, self.profile.units[unit].backward.temporaries - weight)
        return self.scaled(batch_part) + weight * width + self.sharded.buffers(unit)

    def gradients(self, unit: int) -> float:
        """Parameter gradients alive at a unit's peak."""
        setup = self.setup
        if setup.accumulate > 1:  # after the first micro-batch every gradient exists
            return self.profile.parameters * setup.state.gradients / setup.shard
        so_far = self.profile.units[unit].backward.gradients
        # FSDP2 reduce-scatters each block's gradients to shards at the end of its backward.
        finished = self.sharded.finished_bytes(unit) if self.sharded.active else 0
        return (so_far - finished + finished / setup.shard) * setup.state.gradients / 4

    def unit_point(self, unit: int, whole_segment: bool = False) -> PeakPoint:
        """A unit's peak in backward: its layer's backward has just allocated its input's and its weight's
        gradients; what was saved up to it in forward is alive, the rest released."""
        return PeakPoint(gradients=self.gradients(unit), parameters=self.sharded.gathered_parameters(unit),
                         activations=self.activations(unit, whole_segment),
                         temporaries=self.temporaries(unit))

    def cast_point(self, unit: int) -> PeakPoint:
        """Autocast, after a 16-bit layer's backward: the backward of autocast's weight cast turns the 16-bit
        weight gradient into an fp32 one while the 16-bit one is still alive; the layer has released what it
        alone saved and the gradient of its output."""
        weight = self.weight_bytes(unit)
        rest = self.profile.units[unit].backward.temporaries - weight - self.output_bytes(unit)
        temporaries = self.scaled(max(0.0, rest)) + 1.5 * weight + self.sharded.buffers(unit)
        return PeakPoint(gradients=self.gradients(unit), parameters=self.sharded.gathered_parameters(unit),
                         activations=self.activations(unit, released=unit), temporaries=temporaries)

    def points(self) -> list[PeakPoint]:
        moments = own_moments(self.profile.units)
        points = [self.unit_point(unit) for unit in moments]
        points += [self.cast_point(unit) for unit in moments if self.casts_weights(unit)]
        # Non-reentrant checkpointing recomputes a segment's whole forward when backward first reaches it:
        # then every tensor the segment saves is alive at once, with the temporaries of its last unit.
        last_units = [unit for segment, unit in self.last_unit.items() if segment is not None]
        points += [self.unit_point(unit, whole_segment=True) for unit in last_units]
        return points


def update_point(profile: StepProfile, setup: StepSetup) -> PeakPoint:
    """The optimizer update: every gradient, plus foreach's copy of all weights or the for-loop's largest
    one."""
    state = setup.state
    if setup.optimizer_impl == "fused":
        temporaries = 0.0
    elif setup.optimizer_impl == "foreach":
        temporaries = profile.parameters * state.weights / setup.shard
    else:
        temporaries = profile.largest_param_bytes * state.weights / 4
    if setup.optimizer == "sgd-nomomentum":
        temporaries = 0.0
    return PeakPoint(gradients=profile.parameters * state.gradients / setup.shard, parameters=0.0,
                     activations=0.0, temporaries=temporaries)


def resident_bytes(profile: StepProfile, setup: StepSetup) -> dict[str, float]:
    """What the whole step holds: the (sharded) weights and optimizer state, buffers, DDP's gradient
    buckets."""
    state = setup.state
    sharded = state_bytes_per_rank(profile.parameters, state, "fsdp", setup.shard)
    buckets = setup.strategy == "dp" and setup.ranks > 1 and not setup.bucket_view
    return {"parameters": sharded["parameters"], "buffers": profile.peak_bytes["buffers"],
            "optimizer_state": sharded["optimizer_state"],
            "comm_buffers": profile.parameters * state.grad_comm if buckets else 0.0}


def predict_peak_mib(profile_record: Mapping, config: Mapping) -> dict[str, float]:
    """One rank's peak tensor memory (MiB by category, and ``total``) under ``config``
    (docs/distributed.md), from the ``profile`` of one fp32 step (or a record holding it): the largest moment
    of the replayed backward, or of the optimizer update, on top of what the whole step holds."""
    profile = read_profile(profile_record)
    setup = step_setup(profile, config)
    points = [*BackwardReplay(profile, setup).points(), update_point(profile, setup)]
    peak = max(points, key=lambda point: point.total)._asdict()
    resident = resident_bytes(profile, setup)
    by_category = {key: (resident.get(key, 0.0) + peak.get(key, 0.0)) / MIB for key in CATEGORIES}
    return {**by_category, "total": sum(by_category.values())}


def largest_batch(profile_record: Mapping, config: Mapping, budget_mib: float) -> int:
    """The largest per-rank micro-batch whose predicted peak fits ``budget_mib`` (0 if not even one
    sample)."""

    def over_budget(batch: int) -> bool:
        return predict_peak_mib(profile_record, {**config, "data.batch_size": batch})["total"] > budget_mib

    # The peak grows with the batch, so the batches up to 2^25 that fit come first: count them by bisection.
    best = bisect.bisect_left(range(1, 2**25 + 1), True, key=over_budget)
    require(best < 2**25, "budget_mib: fits more than 16 M samples; is the budget in MiB?")
    return best
