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
        """float32 [B, 3, crop, crop] on ``device``: one batched ``decode_jpeg`` of the whole list (nvJPEG's batched
        decode on CUDA), a batch that fails split in halves until the failing image is alone (log2(B) extra
        calls for one bad image, not B), then one resize per distinct decoded size (images of one size resized
        together), one crop and one normalisation for the whole batch. Raises DataError naming the sample id of an
        image that does not decode."""
        from torchvision.io import ImageReadMode, decode_jpeg
        from torchvision.transforms.v2 import functional as F

        images = self._decode(decode_jpeg, ImageReadMode.RGB, list(batch), list(batch.sample_ids), device)
        groups: dict[tuple, list[int]] = {}
        for k, image in enumerate(images):
            groups.setdefault(tuple(image.shape), []).append(k)
        out = torch.empty((len(images), 3, self.crop_size, self.crop_size), dtype=torch.uint8, device=device)
        for ks in groups.values():
            stack = torch.stack([images[k] for k in ks])
            stack = F.resize(stack, [self.resize_size], interpolation=F.InterpolationMode.BILINEAR, antialias=True)
            out[torch.tensor(ks, device=device)] = F.center_crop(stack, [self.crop_size, self.crop_size])
        return F.normalize(out.to(torch.float32).div_(255), mean=self.mean, std=self.std)

    def _decode(self, decode: Any, mode: Any, data: list, ids: list, device: torch.device) -> list:
        """Decoded images of ``data`` (one batched call; halves of a batch that fails, down to single images)."""
        try:
            return decode(data, mode=mode, device=device) if len(data) > 1 else [self._one(decode, mode, data[0], ids[0], device)]
        except RuntimeError:
            half = len(data) // 2
            return (self._decode(decode, mode, data[:half], ids[:half], device)
                    + self._decode(decode, mode, data[half:], ids[half:], device))

    @staticmethod
    def _one(decode: Any, mode: Any, data: torch.Tensor, sid: int, device: torch.device) -> torch.Tensor:
        try:
            return decode(data, mode=mode, device=device)
        except RuntimeError as exc:
            raise DataError(f"sample id {sid}: not a decodable JPEG for data.decode_on_device=true "
                            f"({exc}); decode it on the host (data.decode_on_device=false)", sample_id=sid) from None
