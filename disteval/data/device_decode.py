"""JPEG decoding on the model's device (``data.decode_on_device=true``, imagefolder data): loader workers only
read the files' bytes, and the step decodes each batch with ``torchvision.io.decode_jpeg(..., device=...)``
(nvJPEG on a CUDA device, libjpeg-turbo on the CPU), then applies the ImageNet eval transform there: bilinear
resize of the short side with antialias, center crop, float in [0, 1], normalise. Off by default: the pixels
are close to, not equal to, the host path's (PIL decodes and resizes with its own rounding), so a run with
it is a different run (results.json ``compute.decode_on_device``)."""
from __future__ import annotations

from typing import Any, Sequence

import torch

from disteval.errors import DataError


class EncodedImages(list):
    """A batch of encoded images: a list of uint8 [n_bytes] CPU tensors (the files' bytes), with their sample
    ids. ``stays_on_host``: the loop's device feed leaves it where it is (``decode_jpeg`` reads host bytes)."""

    stays_on_host = True

    def __init__(self, items: Sequence[torch.Tensor], sample_ids: Sequence[int]):
        super().__init__(items)
        self.sample_ids = list(sample_ids)


class EncodedImageFolder:
    """torchvision's ImageFolder at ``root`` whose items are ``(bytes uint8 [n], class index)``: the file read
    with ``torchvision.io.read_file``, nothing decoded (the loader workers do no pixel work)."""

    def __init__(self, root: str):
        from torchvision.datasets import ImageFolder
        from torchvision.io import read_file

        self._folder = ImageFolder(root, loader=read_file)
        self.samples, self.classes = self._folder.samples, self._folder.classes

    def __len__(self) -> int:
        return len(self._folder)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        data, target = self._folder[index]
        # read_file's tensor is backed by the file; a loader worker's copy into shared memory needs its own
        return data.clone(), target


def collate_encoded(items: list[tuple[torch.Tensor, int, int]]) -> tuple[EncodedImages, torch.Tensor, torch.Tensor]:
    """``(EncodedImages, targets int64 [B], sample ids int64 [B])`` of a list of dataset items."""
    ids = [int(i) for _, _, i in items]
    return (EncodedImages([x for x, _, _ in items], ids), torch.tensor([int(y) for _, y, _ in items]),
            torch.tensor(ids, dtype=torch.int64))


class DeviceDecoder:
    """Decodes an ``EncodedImages`` batch on ``device`` into float32 [B, 3, crop, crop] (RGB, normalised).

    Args: resize_size (short side, pixels), crop_size (pixels), mean and std (3 floats each, of [0, 1] values).
    Raises DataError naming the sample id (and the reason) of an image that is not a decodable JPEG."""

    def __init__(self, resize_size: int, crop_size: int, mean: Sequence[float], std: Sequence[float]):
        self.resize_size, self.crop_size = int(resize_size), int(crop_size)
        self.mean, self.std = [float(v) for v in mean], [float(v) for v in std]

    def __call__(self, batch: EncodedImages, device: torch.device) -> torch.Tensor:
        from torchvision.io import ImageReadMode, decode_jpeg
        from torchvision.transforms.v2 import functional as F

        try:
            images = decode_jpeg(list(batch), mode=ImageReadMode.RGB, device=device)
        except RuntimeError:
            images = [self._one(decode_jpeg, ImageReadMode.RGB, data, sid, device)
                      for data, sid in zip(batch, batch.sample_ids)]
        out = torch.empty((len(images), 3, self.crop_size, self.crop_size), dtype=torch.float32, device=device)
        for k, image in enumerate(images):
            image = F.resize(image, [self.resize_size], interpolation=F.InterpolationMode.BILINEAR, antialias=True)
            out[k] = F.center_crop(image, [self.crop_size, self.crop_size]).to(torch.float32).div_(255)
        return F.normalize(out, mean=self.mean, std=self.std)

    @staticmethod
    def _one(decode: Any, mode: Any, data: torch.Tensor, sid: int, device: torch.device) -> torch.Tensor:
        try:
            return decode(data, mode=mode, device=device)
        except RuntimeError as exc:
            raise DataError(f"sample id {sid}: not a decodable JPEG for data.decode_on_device=true "
                            f"({exc}); decode it on the host (data.decode_on_device=false)", sample_id=sid) from None
