"""Every technique a run can use, each declared once: its argument and check, how it is applied to any
network (both loops call :func:`prepare_network` and :func:`build_optimizer`), the facts it adds to the run
record (:func:`record_section`), its words in tables and summaries (:func:`setup_words`), and what the planner
reads to predict it (:data:`PRECISIONS`' bytes per parameter, :data:`OPTIMIZERS`' state). No Lightning here.

| technique | argument | applied by |
|:--|:--|:--|
| mixed precision | ``trainer.precision`` | the loop's autocast (Lightning's precision plugin, Accelerate's) |
| gradient accumulation | ``trainer.accumulate_grad_batches`` | the loop |
| gradient checkpointing | ``model.gradient_checkpointing``: a policy | :func:`apply_checkpointing` |
| optimizer choice | ``model.optimizer``, ``model.optimizer_impl`` | :func:`build_optimizer` |
| a fine-tune | ``model.init_weights``, ``model.freeze`` | :func:`load_weights`, :func:`freeze` |
| memory format, compile | ``model.channels_last``, ``model.compile`` | :func:`prepare_network` |

To add one: its argument in :class:`TechniqueArgs` with a check in :meth:`TechniqueArgs.check`, its
application in :func:`prepare_network` (or its entry in a table here), its facts in :func:`record_section`,
its words in :func:`setup_words`; a config file that uses it, a test, and a line in README.md's
"Add a technique".
"""

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

from modelwright.errors import ConfigError, require

# --- mixed precision --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Precision:
    """A precision: the dtype the matmuls run in, whether autocast runs, Accelerate's ``mixed_precision``
    (None: it has none), and the bytes per parameter the weights, gradients, fp32 master copy, each
    optimizer-state word and each gradient on the wire take. ``lightning``: False for the regimes the planner
    models at scale that no Lightning precision runs (the ZeRO paper's mixed precision)."""

    name: str
    compute_dtype: str
    autocast: bool
    accelerate: str | None
    weights: int
    gradients: int
    master: int
    word: int
    wire: int
    description: str
    lightning: bool = True


# Torch autocast keeps fp32 weights and .grad and casts 16-bit copies on the fly, so the persistent state of
# a *-mixed run is that of 32-true.
_PRECISIONS = (
    Precision("32-true", "float32", False, "no", 4, 4, 0, 4, 4, "fp32 weights, grads and optimizer state"),
    Precision("bf16-mixed", "bfloat16", True, "bf16", 4, 4, 0, 4, 4,
              "torch autocast: fp32 weights and grads, 16-bit copies made on the fly"),
    Precision("16-mixed", "float16", True, "fp16", 4, 4, 0, 4, 4,
              "torch autocast with a loss scaler: fp32 weights and grads, 16-bit copies made on the fly"),
    Precision("bf16-true", "bfloat16", False, None, 2, 2, 0, 2, 2,
              "weights, grads and optimizer state all in 16 bits"),
    Precision("16-true", "float16", False, None, 2, 2, 0, 2, 2,
              "weights, grads and optimizer state all in 16 bits"),
    Precision("64-true", "float64", False, None, 8, 8, 0, 8, 8, "fp64 weights, grads and optimizer state"),
    Precision("playbook-mixed", "bfloat16", True, None, 2, 2, 4, 4, 2,
              "16-bit weights and grads, fp32 master weights and optimizer state", lightning=False),
    Precision("playbook-mixed-fp32-grads", "bfloat16", True, None, 2, 6, 4, 4, 4,
              "as playbook-mixed plus an fp32 gradient accumulation buffer", lightning=False),
)
PRECISIONS = {entry.name: entry for entry in _PRECISIONS}
#: The short names Lightning also accepts, and the planner's.
PRECISION_ALIASES = {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed", "64": "64-true",
                     "playbook": "playbook-mixed"}


def precision(name: object, key: str = "trainer.precision") -> Precision:
    """The :class:`Precision` of ``name`` (a Lightning name or a short one; ``None``: ``32-true``); a
    ConfigError naming ``key`` and the valid names otherwise."""
    text = "32-true" if name is None else str(name).strip().lower()
    text = PRECISION_ALIASES.get(text, text)
    require(text in PRECISIONS, f"{key}: unknown precision {name!r}; valid: {', '.join(PRECISIONS)}")
    return PRECISIONS[text]


# --- optimizer choice -------------------------------------------------------------------------------------


def _moments(count: int) -> Callable[[torch.Size], int]:
    def elements(shape: torch.Size) -> int:
        return count * math.prod(shape)

    return elements


def _factored_second_moment(shape: torch.Size) -> int:
    """``torch.optim.Adafactor``'s state elements for a parameter: a row and a column factor of the second
    moment over its last two dimensions (a matrix of R×C keeps R + C), the whole second moment for a vector;
    no first moment."""
    if len(shape) < 2:
        return math.prod(shape)
    rows = math.prod(shape[:-1])
    columns = math.prod(shape[:-2]) * shape[-1]
    return rows + columns


@dataclass(frozen=True)
class OptimizerChoice:
    """An optimizer: its torch class, the kernels it has, and its state elements per parameter tensor (each
    as wide as the parameter; beside them one scalar step counter per tensor where ``step_counter``)."""

    name: str
    torch_class: str
    kernels: tuple[str, ...]
    state_elements: Callable[[torch.Size], int]
    step_counter: bool
    description: str

    def build(self, params: Iterable[nn.Parameter], args: "TechniqueArgs", lr: float, momentum: float,
              weight_decay: float) -> torch.optim.Optimizer:
        kernel = {"auto": {}, "fused": {"fused": True}, "foreach": {"foreach": True},
                  "for-loop": {"foreach": False}}[args.optimizer_impl]
        cls = getattr(torch.optim, self.torch_class)
        if self.name == "sgd":
            return cls(params, lr=lr, momentum=momentum, nesterov=momentum > 0, weight_decay=weight_decay,
                       **kernel)
        return cls(params, lr=lr, weight_decay=weight_decay, **kernel)

    def state_bytes(self, shapes: Sequence[torch.Size], element_bytes: int = 4, momentum: float = 0.9) -> int:
        """The optimizer state of parameters of ``shapes``, in bytes (fp32 state: 4 B an element)."""
        if self.name == "sgd" and momentum == 0:
            return 0
        counters = 4 * len(shapes) if self.step_counter else 0
        return element_bytes * sum(self.state_elements(shape) for shape in shapes) + counters


OPTIMIZERS = {entry.name: entry for entry in (
    OptimizerChoice("adamw", "AdamW", ("for-loop", "foreach", "fused"), _moments(2), True,
                    "AdamW: two moments per parameter"),
    OptimizerChoice("sgd", "SGD", ("for-loop", "foreach", "fused"), _moments(1), False,
                    "SGD with Nesterov momentum: one momentum buffer per parameter (none at momentum 0)"),
    OptimizerChoice("adafactor", "Adafactor", ("for-loop", "foreach"), _factored_second_moment, True,
                    "Adafactor: a factored second moment (row and column factors of each matrix)"),
)}
OPTIMIZER_IMPLS = ("auto", "for-loop", "foreach", "fused")


def build_optimizer(params: Iterable[nn.Parameter], args: "TechniqueArgs", lr: float, momentum: float,
                    weight_decay: float) -> torch.optim.Optimizer:
    """The run's optimizer over ``params`` (the trainable ones): ``args.optimizer`` with its kernel."""
    return OPTIMIZERS[args.optimizer].build(params, args, lr, momentum, weight_decay)


# --- gradient checkpointing -------------------------------------------------------------------------------

#: Policies every network has: no checkpointing; each direct child that holds parameters.
OFF = "off"
CHILDREN = "children"


def policy_label(policy: str | Sequence[str]) -> str:
    """A policy as the record and the tables name it: ``block``, or ``BasicBlock+EncoderBlock``."""
    return policy if isinstance(policy, str) else "+".join(policy)


def named_policies(network: nn.Module) -> dict[str, tuple[str, ...]]:
    """The named policies ``network``'s class declares (``checkpoint_policies``), beside ``children``."""
    return dict(getattr(type(network), "checkpoint_policies", {}))


def declared_policies(class_path: str) -> list[str]:
    """The named policies of the network class at ``class_path``, without building it; none where it cannot
    be imported."""
    import importlib

    module_name, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError):
        return []
    return list(getattr(cls, "checkpoint_policies", {}))


def _matches(name: str, module: nn.Module, wanted: Sequence[str]) -> bool:
    cls = type(module)
    return name in wanted or cls.__name__ in wanted or f"{cls.__module__}.{cls.__qualname__}" in wanted


def checkpoint_segments(network: nn.Module, policy: str | Sequence[str]) -> list[nn.Module]:
    """The modules ``policy`` recomputes in backward, outermost first (a match inside a match is not one):
    ``off`` none; ``children`` each direct child with parameters; a name the network declares; or a list of
    module class names, class paths or module names (``layer1``, ``stages.0``). A ConfigError naming
    ``model.gradient_checkpointing`` if the policy matches no module."""
    if policy == OFF:
        return []
    if policy == CHILDREN:
        return [child for child in network.children() if any(True for _ in child.parameters())]
    declared = named_policies(network)
    if isinstance(policy, str):
        valid = ", ".join([OFF, CHILDREN, *declared, "a list of module classes or names"])
        require(policy in declared, f"model.gradient_checkpointing: {type(network).__name__} has no policy "
                f"{policy!r}; valid: {valid}")
        policy = declared[policy]
    found: list[nn.Module] = []
    inside: set[int] = set()
    for name, module in network.named_modules():
        if module is network or id(module) in inside or not _matches(name, module, policy):
            continue
        found.append(module)
        inside.update(id(sub) for sub in module.modules())
    classes = sorted({type(module).__name__ for module in network.modules()})
    require(bool(found), f"model.gradient_checkpointing: no module of {type(network).__name__} matches "
            f"{list(policy)}; its module classes: {', '.join(classes)}")
    return found


@contextmanager
def _batchnorm_stats_frozen(module: nn.Module):
    """Keep BatchNorm running statistics as they are while a segment is recomputed: without this, every
    checkpointed BatchNorm would fold the same batch into its statistics twice, and evaluation would differ
    from a run without checkpointing."""
    norms = [norm for norm in module.modules()
             if isinstance(norm, _BatchNorm) and norm.training and norm.track_running_stats]
    saved = [(norm.momentum, norm.num_batches_tracked.clone()) for norm in norms]
    for norm in norms:
        norm.momentum = 0.0
    try:
        yield
    finally:
        for norm, (momentum, tracked) in zip(norms, saved, strict=True):
            norm.momentum = momentum
            norm.num_batches_tracked.copy_(tracked)


class _CheckpointedForward:
    """A module's own forward, recomputed in backward instead of keeping its activations."""

    def __init__(self, forward: Callable) -> None:
        self.forward = forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        contexts = nullcontext(), _batchnorm_stats_frozen(self.forward.__self__)
        return checkpoint(self.forward, *args, use_reentrant=False, context_fn=lambda: contexts, **kwargs)


def apply_checkpointing(network: nn.Module, policy: str | Sequence[str]) -> list[nn.Module]:
    """Recompute ``policy``'s modules of ``network`` in backward (``torch.utils.checkpoint``, non-reentrant);
    the forward is replaced on each instance, so parameter names and ``state_dict`` keys stay.
    Returns them."""
    segments = checkpoint_segments(network, policy)
    for module in segments:
        if not isinstance(module.forward, _CheckpointedForward):
            module.forward = _CheckpointedForward(module.forward)
    return segments


def checkpointed_modules(network: nn.Module) -> list[nn.Module]:
    """The modules of ``network`` that :func:`apply_checkpointing` wrapped, in module order."""
    return [module for module in network.modules()
            if isinstance(module.__dict__.get("forward"), _CheckpointedForward)]


def shard_units(network: nn.Module) -> list[nn.Module]:
    """What FSDP2 shards one by one before the whole network: the network's ``block`` policy where it
    declares one, else its direct children with parameters."""
    if "block" in named_policies(network):
        return checkpoint_segments(network, "block")
    return checkpoint_segments(network, CHILDREN)


# --- a fine-tune: weights from a file, frozen parameters --------------------------------------------------


def _state_dict_in(loaded: Any, path: Path) -> Mapping[str, torch.Tensor]:
    """A plain ``state_dict``, or a Lightning checkpoint's with the LightningModule's ``net.`` prefix off."""
    if isinstance(loaded, Mapping) and isinstance(loaded.get("state_dict"), Mapping):
        loaded = {key.removeprefix("net."): value for key, value in loaded["state_dict"].items()}
    tensors = (isinstance(loaded, Mapping)
               and all(isinstance(value, torch.Tensor) for value in loaded.values()))
    require(tensors and bool(loaded), f"model.init_weights: {path} holds no state_dict (a mapping of names "
            "to tensors, as torch.save(network.state_dict(), path) writes)")
    return loaded


def _weights_for(network: nn.Module, path: str | Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The entries of ``path``'s ``state_dict`` that load into ``network``, and the names of those of
    another shape (a head for another number of classes), which keep their initial values. A file that is
    not a state_dict of this network is a ConfigError naming ``model.init_weights``."""
    path = Path(path)
    require(path.is_file(), f"model.init_weights: no file {path}")
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a file of something else, or a pickle torch will not read
        raise ConfigError(f"model.init_weights: {path} is not a file torch.load reads "
                          f"({type(err).__name__})") from None
    weights = _state_dict_in(loaded, path)
    own = network.state_dict()
    missing = [name for name in own if name not in weights]
    unknown = [name for name in weights if name not in own]
    require(not unknown, f"model.init_weights: {path} has {len(unknown)} entries {type(network).__name__} "
            f"lacks (first: {unknown[0] if unknown else ''}): the state_dict of another network?")
    require(not missing, f"model.init_weights: {path} lacks {len(missing)} entries of "
            f"{type(network).__name__} (first: {missing[0] if missing else ''})")
    reshaped = [name for name, value in weights.items() if value.shape != own[name].shape]
    return {name: value for name, value in weights.items() if name not in reshaped}, reshaped


def load_weights(network: nn.Module, path: str | Path) -> list[str]:
    """Load ``path``'s ``state_dict`` into ``network`` (:func:`_weights_for`); returns the names of the
    entries of another shape, left as initialised."""
    kept, reshaped = _weights_for(network, path)
    network.load_state_dict({**network.state_dict(), **kept})
    return reshaped


def _frozen_names(network: nn.Module, prefixes: Sequence[str]) -> list[str]:
    """The parameters ``prefixes`` freeze, checked: each prefix starts a parameter name, and something is
    left to train (else a ConfigError naming ``model.freeze``)."""
    names = [name for name, _ in network.named_parameters()]
    tops = sorted({name.split(".")[0] for name in names})
    for prefix in prefixes:
        require(any(name.startswith(prefix) for name in names), f"model.freeze: {prefix!r} starts no "
                f"parameter name of {type(network).__name__}; its top-level modules: {', '.join(tops)}")
    frozen = [name for name in names if any(name.startswith(prefix) for prefix in prefixes)]
    require(len(frozen) < len(names), f"model.freeze: {list(prefixes)} freezes every parameter: nothing "
            "would train")
    return frozen


def freeze(network: nn.Module, prefixes: Sequence[str]) -> int:
    """No gradient for the parameters whose names start with one of ``prefixes`` (``layer1``, ``conv1.``):
    they hold no gradients and no optimizer state. Returns the frozen parameters' elements."""
    frozen = set(_frozen_names(network, prefixes))
    elements = 0
    for name, parameter in network.named_parameters():
        if name in frozen:
            parameter.requires_grad_(False)
            elements += parameter.numel()
    return elements


def check_network(network: nn.Module, args: "TechniqueArgs") -> None:
    """What the techniques need of ``network``, before any work: the checkpointing policy matches modules,
    the freeze prefixes name parameters, the weights file fits the network."""
    checkpoint_segments(network, args.gradient_checkpointing)
    _frozen_names(network, args.freeze)
    if args.init_weights:
        _weights_for(network, args.init_weights)


# --- the arguments ----------------------------------------------------------------------------------------


@dataclass
class TechniqueArgs:
    """The model's techniques, one argument each (``model.*``).

    Args:
        optimizer: ``adamw``, ``sgd`` (Nesterov momentum) or ``adafactor`` (factored second moment).
        optimizer_impl: ``auto`` lets PyTorch choose; ``for-loop``, ``foreach`` or ``fused`` force one.
        gradient_checkpointing: ``off``, ``children``, a policy the network names (``block``, ``stage``),
            or a list of module classes or names to recompute in backward.
        channels_last: keep 4-D weights and inputs in NHWC memory format.
        compile: compile the network with ``torch.compile``.
        init_weights: a ``state_dict`` file to start from (a fine-tune); entries of another shape keep
            their initial values.
        freeze: parameter-name prefixes to train no further (``[conv1, layer1]``).
    """

    optimizer: str = "adamw"
    optimizer_impl: str = "auto"
    gradient_checkpointing: str | list[str] = OFF
    channels_last: bool = False
    compile: bool = False
    init_weights: str | None = None
    freeze: list[str] = field(default_factory=list)

    def check(self) -> None:
        """Each technique's own arguments, before any work (what needs the network:
        :func:`prepare_network`)."""
        require(self.optimizer in OPTIMIZERS,
                f"model.optimizer: unknown {self.optimizer!r}; valid: {', '.join(OPTIMIZERS)}")
        kernels = OPTIMIZERS[self.optimizer].kernels
        require(self.optimizer_impl in ("auto", *kernels), f"model.optimizer_impl: {self.optimizer} has no "
                f"{self.optimizer_impl!r} kernel; valid: auto, {', '.join(kernels)}")
        policy = self.gradient_checkpointing
        named = isinstance(policy, str) and bool(policy.strip())
        listed = isinstance(policy, list) and bool(policy) and all(isinstance(name, str) for name in policy)
        require(named or listed, f"model.gradient_checkpointing: {policy!r} is neither a policy name nor a "
                "non-empty list of module classes or names")
        if self.init_weights is not None:
            require(Path(self.init_weights).is_file(), f"model.init_weights: no file {self.init_weights}")
        require(all(isinstance(prefix, str) and prefix for prefix in self.freeze),
                f"model.freeze: a list of parameter-name prefixes, got {self.freeze!r}")


def technique_args(values: Mapping[str, Any]) -> TechniqueArgs:
    """The techniques of a model's arguments (its other keys ignored), checked."""
    names = {argument.name for argument in fields(TechniqueArgs)}
    args = TechniqueArgs(**{key: value for key, value in values.items() if key in names})
    args.check()
    return args


@dataclass(frozen=True)
class Prepared:
    """What :func:`prepare_network` did to a network, for the record."""

    segments: int
    reshaped: tuple[str, ...]
    frozen_elements: int


def prepare_network(network: nn.Module, args: TechniqueArgs, shard: Callable[[nn.Module], None] | None = None,
                    say: Callable[[str], None] = print) -> Prepared:
    """Apply the model's techniques to ``network``, in the order they compose: the weights to start from,
    the frozen parameters, checkpointing, the memory format, sharding (``shard``: FSDP2's ``fully_shard`` per
    unit, under Lightning's ModelParallelStrategy), compile. Both loops call it once, before the optimizer."""
    reshaped: list[str] = []
    if args.init_weights:
        reshaped = load_weights(network, args.init_weights)
        if reshaped:
            say(f"model.init_weights: {', '.join(reshaped)} of another shape in {args.init_weights}: "
                "initialised anew (a new head)")
    frozen = freeze(network, args.freeze) if args.freeze else 0
    segments = apply_checkpointing(network, args.gradient_checkpointing)
    if args.channels_last and shard is None:
        network.to(memory_format=torch.channels_last)
    if shard is not None:
        for unit in [*shard_units(network), network]:
            shard(unit)
    if args.compile:
        network.compile()
    return Prepared(len(segments), tuple(reshaped), frozen)


# --- the record and the tables ----------------------------------------------------------------------------


@dataclass(frozen=True)
class LoopFacts:
    """What the loop that ran knows of the techniques it applies itself."""

    precision: str
    precision_requested: str | None
    accumulate_grad_batches: int
    strategy: str
    strategy_class: str | None
    world_size: int
    num_nodes: int


def short_name(class_name: str) -> str:
    """A built-in network's short name (``ResNet18``: ``resnet18``), else the class name itself."""
    from modelwright.train.models import SHORT_NAMES

    by_class = {cls: short for short, cls in SHORT_NAMES.items()}
    return by_class.get(class_name, class_name)


def network_class(network: nn.Module) -> type:
    """The network's own class: FSDP2's ``fully_shard`` gives a sharded module a class of its own,
    ``FSDP<name>``, derived from ``FSDPModule`` and the network's class."""
    from torch.distributed.fsdp import FSDPModule

    return next(cls for cls in type(network).__mro__ if not issubclass(cls, FSDPModule))


def network_name(network: nn.Module) -> str:
    """The short name of a built-in network (``resnet18``), else the network's class name."""
    return short_name(network_class(network).__name__)


def record_section(args: TechniqueArgs | None, network: nn.Module, loop: LoopFacts,
                   measured: Mapping[str, Any]) -> dict[str, Any]:
    """The record's ``techniques``: what the loop applied, what the model's arguments asked for (``args``
    None: a LightningModule of the user's, whose own code chose), and what the step probe saw (``measured``:
    micro-batch, accumulation, memory format, compile, optimizer kernel). Both loops and the study's failure
    records build it here."""
    asked = args or TechniqueArgs(optimizer="", gradient_checkpointing=OFF)
    cls = network_class(network)
    section = {
        **measured,
        "model_name": short_name(cls.__name__),
        "network": f"{cls.__module__}.{cls.__qualname__}",
        "optimizer": asked.optimizer or None,
        "gradient_checkpointing": policy_label(asked.gradient_checkpointing),
        "checkpointed_segments": len(checkpointed_modules(network)),
        "init_weights": Path(asked.init_weights).name if asked.init_weights else None,
        "frozen": list(asked.freeze),
        "trainable_parameters": sum(p.numel() for p in network.parameters() if p.requires_grad),
        "precision": loop.precision,
        "precision_requested": loop.precision_requested,
        "accumulate_grad_batches": loop.accumulate_grad_batches,
        "strategy": loop.strategy,
        "strategy_class": loop.strategy_class,
        "world_size": loop.world_size,
        "num_nodes": loop.num_nodes,
    }
    if section.get("channels_last") is None:  # sharded weights cannot be read: what the config asked for
        section["channels_last"] = asked.channels_last
    return section


def configured_section(config: Mapping, world_size: int, effective_batch: int | None) -> dict[str, Any]:
    """The record's ``techniques`` of a run that wrote none (it died first): what its resolved ``config``
    asked for, no more."""
    from modelwright.record import get_path

    network = get_path(config, "model.network")
    class_path = network.get("class_path") if isinstance(network, Mapping) else network
    if "network" in (get_path(config, "model") or {}).get("init_args", {}) and network is None:
        class_path = "modelwright.train.models.ResNet18"  # the classifier's default
    policy = get_path(config, "model.gradient_checkpointing")
    return {"network": class_path,
            "model_name": short_name(class_path.rsplit(".", 1)[-1]) if class_path else None,
            "optimizer": get_path(config, "model.optimizer"),
            "gradient_checkpointing": policy_label(policy) if policy is not None else None,
            "frozen": list(get_path(config, "model.freeze") or []),
            "precision_requested": str(get_path(config, "trainer.precision")),
            "accumulate_grad_batches": get_path(config, "trainer.accumulate_grad_batches"),
            "micro_batch_size": get_path(config, "data.batch_size"),
            "world_size": world_size, "effective_batch_size": effective_batch}


def optimizer_words(optimizer_impl: Any) -> str | None:
    """``torch.optim.AdamW[foreach]`` as ``AdamW foreach``; None when the record does not name the kernel."""
    if not isinstance(optimizer_impl, str) or "[" not in optimizer_impl:
        return None
    name, kernel = optimizer_impl.split("[", 1)
    return f"{name.rsplit('.', 1)[-1]} {kernel.rstrip(']')}"


def setup_words(techniques: Mapping[str, Any], cpu_malloc: str | None = None,
                spelled: bool = False) -> list[str]:
    """A run's techniques in a few words, the way tables name them: ``bf16-mixed``, ``32×4``, ``ckpt
    block``, ``frozen layer1``, ``channels_last``, ``AdamW foreach``; ``spelled``: as the end-of-run summary
    names them (``micro-batch 32 × accumulate 4``, ``checkpointing block``, the strategy always)."""
    micro = techniques.get("micro_batch_size")
    accumulate = techniques.get("accumulate_grad_batches") or 1
    policy = techniques.get("gradient_checkpointing")
    world = techniques.get("world_size") or 1
    words = [str(techniques.get("precision") or "?")]
    if spelled:
        words += [f"micro-batch {micro} × accumulate {accumulate}", f"checkpointing {policy or OFF}"]
    else:
        words.append(f"{micro}×{accumulate}" if accumulate != 1 else str(micro))
    if world != 1 or spelled:
        words.append(f"{techniques.get('strategy')} ×{world}")
    if policy not in (None, OFF) and not spelled:
        words.append(f"ckpt {policy}")
    if techniques.get("init_weights"):
        words.append(f"from {techniques['init_weights']}")
    if techniques.get("frozen"):
        words.append("frozen " + ", ".join(techniques["frozen"]))
    words += [key for key in ("channels_last", "compile") if techniques.get(key)]
    if cpu_malloc == "system":
        words.append("system malloc")
    kernel = optimizer_words(techniques.get("optimizer_impl"))
    if kernel:
        words.append(kernel)
    elif techniques.get("optimizer"):
        words.append(str(techniques["optimizer"]))
    return words
