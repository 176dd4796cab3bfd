"""The optimizer and learning-rate schedule of every loop (Lightning's and the Accelerate loop); no
Lightning."""

import math

import torch


def build_optimizer(params, *, optimizer: str, lr: float, momentum: float, weight_decay: float,
                    optimizer_impl: str = "auto") -> torch.optim.Optimizer:
    """SGD (Nesterov momentum when ``momentum > 0``) or AdamW; ``optimizer_impl`` forces
    for-loop/foreach/fused."""
    by_impl = {"auto": {}, "fused": {"fused": True}, "foreach": {"foreach": True},
               "for-loop": {"foreach": False}}
    kernel = by_impl[optimizer_impl]
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=momentum > 0,
                               weight_decay=weight_decay, **kernel)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **kernel)


def build_scheduler(optimizer: torch.optim.Optimizer, scheduler: str, *, lr: float,
                    total_steps: int) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The learning-rate schedule over ``total_steps`` optimizer steps (``None`` for ``none``).

    ``onecycle`` rises linearly from ``lr / 25`` to ``lr`` over the first quarter, then follows a cosine to
    ``lr / 1e4``; written as a LambdaLR because torch's OneCycleLR divides by zero on runs of a few steps.
    """
    total_steps = max(1, total_steps)
    if scheduler == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
    if scheduler != "onecycle":
        return None
    warmup = max(1, round(0.25 * total_steps))

    def factor(step: int) -> float:
        if step < warmup:
            return 1 / 25 + (1 - 1 / 25) * step / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 1e-4 + (1 - 1e-4) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
