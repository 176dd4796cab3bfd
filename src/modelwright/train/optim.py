"""The learning-rate schedule of every loop (Lightning's and the Accelerate loop); no Lightning. The optimizer
is a technique: :func:`modelwright.techniques.build_optimizer`."""

import math

import torch


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
