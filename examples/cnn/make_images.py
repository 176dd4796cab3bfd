"""Write a small image folder for the example: four classes of 48x48 grey PNGs (a bright disc, square, cross
or stripes on noise), torchvision's ImageFolder layout, into examples/cnn/images/{train,val}/<class>/.

To run: ``uv run python examples/cnn/make_images.py`` (a second run rewrites the same files).
"""

from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent / "images"
SIZE = 48
COUNTS = {"train": 256, "val": 64}  # per class


def shape(name: str, rng: np.random.Generator) -> np.ndarray:
    """One picture of class ``name``, placed and sized at random, on noise."""
    y, x = np.mgrid[:SIZE, :SIZE]
    cy, cx = rng.integers(14, SIZE - 14, size=2)
    r = rng.integers(7, 13)
    masks = {
        "disc": (y - cy) ** 2 + (x - cx) ** 2 < r**2,
        "square": (abs(y - cy) < r) & (abs(x - cx) < r),
        "cross": ((abs(y - cy) < 3) & (abs(x - cx) < r)) | ((abs(x - cx) < 3) & (abs(y - cy) < r)),
        "stripes": ((x + rng.integers(0, 8)) // 4) % 2 == 0,
    }
    picture = rng.normal(60, 25, (SIZE, SIZE))
    picture[masks[name]] += 140
    return np.clip(picture, 0, 255).astype(np.uint8)


def main() -> None:
    rng = np.random.default_rng(0)
    for split, count in COUNTS.items():
        for name in ("disc", "square", "cross", "stripes"):
            folder = ROOT / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for index in range(count):
                Image.fromarray(shape(name, rng), mode="L").save(folder / f"{index:04d}.png")
    print(f"wrote {sum(COUNTS.values()) * 4} images under examples/cnn/images/")


if __name__ == "__main__":
    main()
