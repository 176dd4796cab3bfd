"""What a device-hour costs, with the source of every price: the GPUs the planner knows, and a CPU by its
vCPUs. Prices are estimates from dated listings; they move."""

from collections.abc import Mapping
from typing import NamedTuple

#: USD per device-hour (low, high) in the dated source.
DEFAULT_PRICES = {"A100 80GB": (1.10, 3.00), "H100 SXM": (2.50, 5.00), "H200": (3.50, 7.00)}
PRICE_SOURCE = "third-party GPU cloud listings (2026-05)"
#: A CPU is priced by the vCPUs it has: AWS EC2 on-demand, us-east-1, Linux, m7g.large (general purpose,
#: 2 vCPU, 8 GiB; Graviton, Arm), $0.0816 per hour as listed by factualminds.com on 2026-06-17 ("Amazon EC2
#: On-Demand Pricing: Instance Families, Regional Multipliers, and the Graviton Crossover (2026)"), per vCPU.
CPU_USD_PER_VCPU_HOUR = 0.0816 / 2
CPU_PRICE_SOURCE = ("AWS EC2 on-demand m7g.large (2 vCPU, 8 GiB, us-east-1, Linux) $0.0816/h ÷ 2 vCPU, "
                    "factualminds.com 2026-06-17; an Arm instance's vCPU, not this machine's")
#: A GPU's name as the hardware reports it, by the words that pick its price.
GPU_NAMES = {"A100": "A100 80GB", "H100": "H100 SXM", "H200": "H200"}
#: How to price what the planner cannot: one line, printed once.
HOW_TO_PRICE = ("not priced (a CPU step at a GPU's listing would mislead) — pass --price_per_hour USD (what "
                "one device-hour costs), or --gpu_step_time_ms MS to price a GPU step at the --device's "
                "listing")


class MachinePrice(NamedTuple):
    """What the devices a run used cost per hour, and where the price comes from."""

    usd_per_hour: float
    what: str  # "2 vCPU", "8 × H100 SXM"
    source: str


def gpu_key(device_name: str) -> str | None:
    """The :data:`DEFAULT_PRICES` key of a GPU's reported name (``NVIDIA H100 80GB HBM3`` → ``H100 SXM``)."""
    return next((key for word, key in GPU_NAMES.items() if word in device_name.upper()), None)


def machine_price(hardware: Mapping, devices: int = 1) -> MachinePrice | None:
    """The hourly price of a run's machine from its record's ``hardware``: a CPU's vCPUs (those the run could
    use, else the machine's), or ``devices`` GPUs at the low end of their listing; None for a device the
    planner has no price for."""
    if hardware.get("accelerator") == "cpu":
        vcpus = hardware.get("cpu_cores_available") or hardware.get("cpu_cores")
        if not vcpus:
            return None
        return MachinePrice(vcpus * CPU_USD_PER_VCPU_HOUR, f"{vcpus} vCPU", CPU_PRICE_SOURCE)
    key = gpu_key(str(hardware.get("device_name") or ""))
    if key is None:
        return None
    low, _ = DEFAULT_PRICES[key]
    return MachinePrice(devices * low, f"{devices} × {key}", f"{key} ${low:.2f}/h, low end; {PRICE_SOURCE}")
