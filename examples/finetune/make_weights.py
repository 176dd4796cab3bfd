"""Save the ``state_dict`` the fine-tune example starts from: torchvision's resnet18 (ImageNet layout: a 7x7
stem, 1000 classes), to examples/finetune/resnet18-torchvision.pt.

With no network here its weights are torchvision's initialisation, not ImageNet's: the example measures
memory and time, which do not depend on the values. A real fine-tune points ``model.init_weights`` at a file
of its own, e.g. one saved by ``torch.save(resnet18(weights="IMAGENET1K_V1").state_dict(), "resnet18.pt")``
(``torchvision.models.resnet18``).

To run: ``uv run python examples/finetune/make_weights.py``.
"""

from pathlib import Path

import torch
import torchvision

TARGET = Path(__file__).resolve().parent / "resnet18-torchvision.pt"


def main() -> None:
    torch.manual_seed(0)
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), TARGET)
    print("wrote examples/finetune/resnet18-torchvision.pt")


if __name__ == "__main__":
    main()
