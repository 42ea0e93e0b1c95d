"""Generated image-text pairs (offline): images of coloured shapes, several captions per image, as COCO
captions / Flickr30k have. Sample ids: images first ([0, n_images)), then captions
([n_images, n_images * (1 + captions_per_image))); every item's target is its image index (the pair group),
so a caption's correct image and an image's correct captions are the items with the same target.
The colour is the image's class (zero-shot classification over ``COLOURS``)."""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset

COLOURS = ("red", "green", "blue", "yellow", "cyan", "magenta", "white", "orange")
_RGB = {"red": (1, 0, 0), "green": (0, 1, 0), "blue": (0, 0, 1), "yellow": (1, 1, 0), "cyan": (0, 1, 1),
        "magenta": (1, 0, 1), "white": (1, 1, 1), "orange": (1, 0.5, 0)}
SHAPES = ("square", "disc", "bar")
CAPTIONS = ("a photo of a {colour} {shape}.", "a {size} {colour} {shape} on a black background.",
            "a {shape} coloured {colour}.", "{colour} {shape}, {size}.", "an image showing one {colour} {shape}.")


class MixedBatch(NamedTuple):
    """A batch of image and text items: ``kinds`` int64 [B] (0 image, 1 text) in item order, ``images`` float32
    [n_images, 3, H, W] and ``texts`` (list of n_text strings), each in item order within its kind."""

    kinds: torch.Tensor
    images: torch.Tensor | None
    texts: list[str]


class ImageTextPairs(Dataset):
    """``n_images`` generated images (float32 [3, size, size] in [0, 1]) and ``captions_per_image`` captions
    each. Items ``(image tensor or caption str, image index, sample id)``. Deterministic in ``seed``.
    Raises ValueError for n_images < 1 or captions_per_image not in 1..5."""

    def __init__(self, n_images: int, captions_per_image: int = 3, size: int = 32, seed: int = 0):
        if n_images < 1 or not 1 <= captions_per_image <= len(CAPTIONS):
            raise ValueError(f"need n_images >= 1 and captions_per_image in 1..{len(CAPTIONS)}, got "
                             f"{n_images}, {captions_per_image}")
        rng = np.random.default_rng(seed)
        self.n_images, self.cpi, self.size = n_images, captions_per_image, size
        self.colour = rng.integers(0, len(COLOURS), n_images)
        self.shape = rng.integers(0, len(SHAPES), n_images)
        self.extent = rng.integers(size // 4, size // 2 + 1, n_images)
        self.centre = rng.integers(size // 4, 3 * size // 4, (n_images, 2))
        self.noise_seed = rng.integers(0, 2**31, n_images)

    def __len__(self) -> int:
        return self.n_images * (1 + self.cpi)

    @property
    def num_classes(self) -> int:
        return len(COLOURS)

    def image_class(self, i: int) -> int:
        """The colour index of image ``i`` (its zero-shot class)."""
        return int(self.colour[i])

    def image(self, i: int) -> torch.Tensor:
        s, (cy, cx), e = self.size, self.centre[i], int(self.extent[i]) // 2
        yy, xx = np.mgrid[0:s, 0:s]
        shape = SHAPES[self.shape[i]]
        if shape == "square":
            mask = (abs(yy - cy) <= e) & (abs(xx - cx) <= e)
        elif shape == "disc":
            mask = (yy - cy) ** 2 + (xx - cx) ** 2 <= e * e
        else:
            mask = (abs(yy - cy) <= max(1, e // 3)) & (abs(xx - cx) <= e)
        rgb = np.array(_RGB[COLOURS[self.colour[i]]], dtype=np.float32)[:, None, None]
        noise = np.random.default_rng(int(self.noise_seed[i])).random((3, s, s), dtype=np.float32) * 0.1
        return torch.from_numpy(mask[None].astype(np.float32) * rgb * 0.9 + noise)

    def caption(self, i: int, j: int) -> str:
        size = "small" if self.extent[i] < 3 * self.size // 8 else "large"
        return CAPTIONS[j].format(colour=COLOURS[self.colour[i]], shape=SHAPES[self.shape[i]], size=size)

    def __getitem__(self, index: int) -> tuple[Any, int, int]:
        if index < self.n_images:
            return self.image(index), index, index
        c = index - self.n_images
        i, j = c // self.cpi, c % self.cpi
        return self.caption(i, j), i, index


def collate_mixed(items: list[tuple[Any, int, int]]) -> tuple[MixedBatch, torch.Tensor, torch.Tensor]:
    """Collate image and caption items into ``(MixedBatch, targets int64 [B], sample ids int64 [B])``."""
    kinds = torch.tensor([0 if isinstance(x, torch.Tensor) else 1 for x, _, _ in items], dtype=torch.int64)
    images = [x for x, _, _ in items if isinstance(x, torch.Tensor)]
    texts = [x for x, _, _ in items if not isinstance(x, torch.Tensor)]
    targets = torch.tensor([y for _, y, _ in items], dtype=torch.int64)
    ids = torch.tensor([i for _, _, i in items], dtype=torch.int64)
    return MixedBatch(kinds, torch.stack(images) if images else None, texts), targets, ids
