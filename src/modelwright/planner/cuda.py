"""One GPU's view of a predicted peak: what ``torch.cuda.max_memory_allocated`` should read for a config,
from the tensors alive at the peak of its rehearsed step (:mod:`modelwright.measure.rehearsal`).

The autograd graph saves the same tensors on either device, so the tensors are the rehearsal's, one by one;
on a GPU each is a block of PyTorch's caching allocator, rounded as it rounds them, and the step allocates
more beside the tensors MemTracker sees. Every figure carries its basis: ``modelled`` (from the profile and
the allocator's rules), ``assumed`` (a stated fact and its source) or ``guessed`` (no source: a range for the
measurement to settle).

The allocator's rules, from PyTorch's ``c10/cuda/CUDACachingAllocator.cpp`` (``round_size``,
``get_allocation_size``, ``should_split``, ``alloc_found_block``): a request is rounded up to a multiple of
512 B (``kMinBlockSize``); up to 1 MiB (``kSmallSize``) it is served from the small pool, whose segments are
2 MiB (``kSmallBuffer``); a larger request that no cached block fits gets a new segment of 20 MiB
(``kLargeBuffer``) below 10 MiB (``kMinLargeAlloc``), else of its size rounded up to 2 MiB (``kRoundLarge``).
A block keeps the rest of its segment, and the allocated count includes it, unless the rest can be split
off: 512 B or more in the small pool, more than 1 MiB in the large one. Segments go back to the driver only
on ``empty_cache`` or an out-of-memory retry, so the reserved peak is never below the allocated one.
"""

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from modelwright.errors import require
from modelwright.measure.memtracker import TRACKER_TO_CATEGORY
from modelwright.measure.rehearsal import Rehearsal

MIB = 2**20

MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = MIB  # kSmallSize: the largest request of the small pool
SMALL_SEGMENT = 2 * MIB  # kSmallBuffer
LARGE_SEGMENT = 20 * MIB  # kLargeBuffer: a new segment for a request of 1-10 MiB
MIN_LARGE_ALLOC = 10 * MIB  # kMinLargeAlloc
ROUND_LARGE = 2 * MIB  # kRoundLarge
ALLOCATOR_SOURCE = ("PyTorch c10/cuda/CUDACachingAllocator.cpp: kMinBlockSize, kSmallSize, kSmallBuffer, "
                    "kLargeBuffer, kMinLargeAlloc, kRoundLarge; round_size, get_allocation_size, "
                    "should_split")

# cuBLAS takes its workspace from the caching allocator, once per (handle, stream), and keeps it: 32 MiB on
# compute capability 9.0 (":4096:8"), 1 MiB for cuBLASLt (CUBLASLT_WORKSPACE_SIZE's default, in KiB).
CUBLAS_WORKSPACE = 32 * MIB
CUBLASLT_WORKSPACE = MIB
CUBLAS_SOURCE = ("PyTorch aten/src/ATen/cuda/CublasHandlePool.cpp: parseChosenWorkspaceSize (sm90 default "
                 "4096 KiB x 8), parseCUDABlasLtWorkspaceSize (1024 KiB), setWorkspaceForHandle; "
                 "their messages are in torch 2.11.0+cu130's libtorch_cuda.so")
GRAD_SCALER_TENSORS = 3  # torch.amp.GradScaler's scale, growth tracker and found_inf: one block each


@dataclass(frozen=True)
class Figure:
    """One predicted figure in MiB, with its basis (modelled, assumed or guessed) and how it was made."""

    mib: float
    basis: str
    how: str


@dataclass(frozen=True)
class CudaPeak:
    """A config's predicted peak on one GPU: MemTracker's categories as a CUDA run counts them (each tensor
    rounded), what the allocator holds beside them, and the totals."""

    categories: Mapping[str, Figure]
    beside_tensors: Mapping[str, Figure]
    cudnn_workspace_max_mib: float
    small_pool_slack_mib: float  # the small pool's whole 2 MiB segments, over the small blocks they hold

    @property
    def allocated_mib(self) -> float:
        """The point prediction of ``max_memory_allocated``: every figure, cuDNN's workspace at 0."""
        figures = [*self.categories.values(), *self.beside_tensors.values()]
        return sum(figure.mib for figure in figures)

    @property
    def allocated_upper_mib(self) -> float:
        """With cuDNN's workspace at its guessed largest."""
        return self.allocated_mib + self.cudnn_workspace_max_mib

    @property
    def reserved_floor_mib(self) -> float:
        """Reserved is never below the allocated peak, and the small pool holds whole segments."""
        return self.allocated_mib + self.small_pool_slack_mib


def rounded_request(nbytes: int) -> int:
    """A request as the allocator rounds it: up to a multiple of 512 B; an empty tensor allocates nothing."""
    return 0 if nbytes <= 0 else -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def is_small(nbytes: int) -> bool:
    """Whether a request is served from the small pool."""
    return 0 < rounded_request(nbytes) <= SMALL_SIZE


def segment_bytes(nbytes: int) -> int:
    """The cudaMalloc a request makes when no cached block fits it."""
    size = rounded_request(nbytes)
    if size == 0:
        return 0
    if size <= SMALL_SIZE:
        return SMALL_SEGMENT
    if size < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-size // ROUND_LARGE) * ROUND_LARGE


def fresh_block_bytes(nbytes: int) -> int:
    """What the allocated count grows by for a request served from a new segment: the rounded request, or
    the whole segment where the rest is too small to split off."""
    size = rounded_request(nbytes)
    rest = segment_bytes(nbytes) - size
    keeps_rest = rest < MIN_BLOCK if size <= SMALL_SIZE else rest <= SMALL_SIZE
    return size + rest if keeps_rest else size


def rounding_bytes(sizes: Sequence[float]) -> float:
    """What rounding each tensor to its block adds to their sum."""
    return sum(fresh_block_bytes(int(size)) - size for size in sizes if size > 0)


#: The categories of the tensors that live through the step: the small pool keeps their segments.
PERSISTENT = ("parameters", "buffers", "gradients", "optimizer_state")


def sized_by_category(tensors: Sequence[tuple[str, float]]) -> dict[str, list[float]]:
    """The sizes of the tensors alive at the peak (MemTracker's type, bytes), by the anatomy's category."""
    by_category: dict[str, list[float]] = {}
    for kind, size in tensors:
        category = TRACKER_TO_CATEGORY.get(kind, "other")
        by_category.setdefault(category, []).append(size)
    return by_category


def rounded_categories(tensors: Sequence[tuple[str, float]]) -> dict[str, Figure]:
    """Each category of the rehearsed peak with each of its tensors rounded to its allocator block; the data
    (``inputs``: the batch copied to the device) too."""
    figures = {}
    for category, sizes in sized_by_category(tensors).items():
        figures[category] = Figure(sum(fresh_block_bytes(round(size)) for size in sizes) / MIB, "modelled",
                                   f"{len(sizes)} tensors alive at the rehearsed peak, each rounded to its "
                                   "block")
    return figures


def beside_tensors(module_types: frozenset[str], precision: str) -> dict[str, Figure]:
    """What the allocator holds beside the tensors MemTracker counts: cuBLAS workspaces where the network has
    a linear layer, the GradScaler's scalars under fp16."""
    figures = {}
    if module_types & {"Linear", "NonDynamicallyQuantizableLinear"}:
        figures["cublas_workspace_forward"] = Figure(
            CUBLAS_WORKSPACE / MIB, "assumed", "the linear layer's forward, on the main thread's handle: "
            + CUBLAS_SOURCE)
        figures["cublaslt_workspace"] = Figure(
            CUBLASLT_WORKSPACE / MIB, "assumed", "addmm with a bias goes through cuBLASLt, whose workspace "
            "is separate unless TORCH_CUBLASLT_UNIFIED_WORKSPACE is set: " + CUBLAS_SOURCE)
        figures["cublas_workspace_backward"] = Figure(
            CUBLAS_WORKSPACE / MIB, "guessed", "inferred, not read: autograd runs CUDA backward on its own "
            "device thread, whose handle (the pool is per thread) gets a workspace of its own")
    if precision == "16-mixed":
        figures["grad_scaler"] = Figure(GRAD_SCALER_TENSORS * MIN_BLOCK / MIB, "assumed",
                                        "torch.amp.GradScaler: three scalars, one 512 B block each")
    return figures


def predict_cuda_peak(rehearsal: Rehearsal, micro_batch: int, precision: str) -> CudaPeak:
    """The peak on one GPU of the rehearsed config at ``micro_batch`` (``precision``: its Lightning name)."""
    tensors = rehearsal.tensors_at_peak(micro_batch)
    by_category = sized_by_category(tensors)
    # cuDNN's convolution workspace is taken from the allocator for the call and given back after it, so it
    # adds to the peak where a convolution's backward is the peak's moment. Its size is the algorithm's,
    # which cuDNN's heuristics choose at run time: guessed, with no source, at most the largest activation.
    largest = max(by_category.get("activations", [0.0]))
    extras = beside_tensors(rehearsal.module_types, precision)
    # The small pool's segments are whole: the small tensors that live through the step (and cuBLASLt's 1 MiB
    # workspace, a small request) fill ceil(bytes / 2 MiB) of them.
    small = sum(rounded_request(round(size)) for category in PERSISTENT
                for size in by_category.get(category, []) if is_small(round(size)))
    if "cublaslt_workspace" in extras:
        small += CUBLASLT_WORKSPACE
    slack = -(-small // SMALL_SEGMENT) * SMALL_SEGMENT - small
    return CudaPeak(rounded_categories(tensors), extras, largest / MIB, slack / MIB)


def largest_cuda_batch(rehearsal: Rehearsal, precision: str, budget_mib: float) -> int:
    """The largest micro-batch whose predicted allocated peak fits ``budget_mib`` (0 if not even one)."""

    def over_budget(batch: int) -> bool:
        return predict_cuda_peak(rehearsal, batch, precision).allocated_mib > budget_mib

    best = bisect.bisect_left(range(1, 2**25 + 1), True, key=over_budget)
    require(best < 2**25, "budget_mib: fits more than 16 M samples; is the budget in MiB?")
    return best


def figure_json(figure: Figure) -> dict:
    return {"mib": figure.mib, "basis": figure.basis, "how": figure.how}


def peak_json(peak: CudaPeak) -> dict:
    """A prediction as the predictions file holds it."""
    cudnn = Figure(0.0, "guessed", f"0 to {peak.cudnn_workspace_max_mib:.4g} MiB (the largest saved tensor): "
                   "a convolution's workspace, taken for the call and given back; not in the point figure")
    return {"categories_mib": {name: figure_json(figure) for name, figure in peak.categories.items()},
            "beside_tensors_mib": {name: figure_json(figure) for name, figure in peak.beside_tensors.items()},
            "cudnn_workspace_mib": {**figure_json(cudnn), "max_mib": peak.cudnn_workspace_max_mib},
            "allocated_mib": peak.allocated_mib, "allocated_upper_mib": peak.allocated_upper_mib,
            "reserved_floor_mib": peak.reserved_floor_mib}
