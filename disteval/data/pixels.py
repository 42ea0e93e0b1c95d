"""Imagefolder images as uint8 pixels on the host, normalised on the model's device.

The loader workers read each file, decode it and apply the deterministic part of the ImageNet eval transform
(bilinear resize of the short side with antialias, center crop) and ship uint8 [3, crop, crop]: a quarter of the
float32 bytes through the worker pipe and the host-to-device copy. ``PixelNormalizer`` then does, on the device,
what torchvision's ``ConvertImageDtype(float32)`` + ``Normalize`` did per image: ``(x.float() / 255 - mean) / std``
with the same float32 operations in the same order, so the model sees the same floats bit for bit (elementwise
IEEE operations do not depend on the batch around them).

Decoders (``data.decode``): ``pil`` (Pillow, what torchvision's ImageFolder loader does: the reference) and
``turbo`` (libjpeg-turbo through simplejpeg, with DCT-domain downscaling by 1/2, 1/4 or 1/8 when the image is at
least that much larger than the resize target; PIL for a file that is not a JPEG). ``turbo`` may change pixels:
results.json records the decoder and ``benchmarks/input_pipeline.py --parity`` measures the difference.

Each item's read, decode and transform seconds are added into a shared-memory table (one row per loader worker)
that the rank reads after its loop (``StageClock``): results.json ``pipeline``."""
from __future__ import annotations

import io
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from torch.utils.data import get_worker_info

from disteval.common.pipeline import DECODERS
from disteval.errors import ConfigError

HOST_STAGES = ("read", "decode", "transform", "collate")  # seconds summed per loader worker (collate: per batch)
_JPEG_MAGIC = b"\xff\xd8\xff"


class StageClock:
    """Seconds and item counts of the host stages (``HOST_STAGES``), summed per loader worker in a float64
    tensor [workers + 1, stages + 1] in shared memory (row 0: the rank's own process when it loads without
    workers; the last column counts items). Made before the workers fork, so their writes reach the rank."""

    def __init__(self, max_workers: int = 64):
        self.table = torch.zeros(max_workers + 1, len(HOST_STAGES) + 1, dtype=torch.float64).share_memory_()

    def _row(self) -> int:
        info = get_worker_info()
        return 0 if info is None else min(info.id + 1, self.table.shape[0] - 1)

    def add(self, seconds: Sequence[float]) -> None:
        """Add one item's read, decode and transform seconds to this process's row (and count the item)."""
        row = self._row()
        for j, s in enumerate(seconds):
            self.table[row, j] += s
        self.table[row, -1] += 1

    def add_collate(self, seconds: float) -> None:
        """Add one batch's collation seconds to this process's row."""
        self.table[self._row(), HOST_STAGES.index("collate")] += seconds

    def reset(self) -> None:
        self.table.zero_()

    def totals(self) -> dict:
        """``{stage: seconds summed over all workers, "items": n, "workers_active": k}``."""
        t = self.table
        out = {name: float(t[:, j].sum()) for j, name in enumerate(HOST_STAGES)}
        out["items"] = int(t[:, -1].sum())
        out["workers_active"] = int((t[:, -1] > 0).sum())
        return out


def pixel_transform(resize_size: int, crop_size: int):
    """The deterministic part of torchvision's ImageNet eval preset on a PIL image: bilinear resize of the short
    side to ``resize_size`` with antialias, center crop ``crop_size``, to uint8 [3, crop, crop] (RGB)."""
    from torchvision import transforms as T

    return T.Compose([T.Resize(resize_size, interpolation=T.InterpolationMode.BILINEAR, antialias=True),
                      T.CenterCrop(crop_size), T.PILToTensor()])


def check_decoder(decode: str) -> None:
    """Raises ConfigError naming ``data.decode`` for an unknown decoder or a missing binding."""
    if decode not in DECODERS:
        raise ConfigError("data.decode", f"{decode!r} is not one of {list(DECODERS)}")
    if decode == "turbo":
        try:
            import simplejpeg  # noqa: F401 - only whether it imports
        except ImportError as exc:
            raise ConfigError("data.decode", "turbo needs simplejpeg (libjpeg-turbo): pip install "
                              f"'disteval[turbo]' ({exc})") from None


def decode_image(data: bytes, decode: str, resize_size: int):
    """A PIL RGB image of the encoded ``data``. ``pil``: ``Image.open(...).convert("RGB")`` (torchvision's
    ImageFolder loader). ``turbo``: simplejpeg's libjpeg-turbo decode, scaled in the DCT domain to the smallest
    of 1/1, 1/2, 1/4, 1/8 whose short side is still >= ``resize_size`` (the resize then starts from fewer
    pixels); not a JPEG: as ``pil``. Raises what the decoder raises on a damaged file."""
    from PIL import Image

    if decode == "turbo" and data[:3] == _JPEG_MAGIC:
        import simplejpeg

        w, h = _jpeg_size(data)
        scale = 1
        while scale < 8 and min(w, h) // (scale * 2) >= resize_size:
            scale *= 2
        arr = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=-(-h // scale), min_width=-(-w // scale))
        return Image.fromarray(arr, "RGB")
    with Image.open(io.BytesIO(data)) as img:
        return img.convert("RGB")


def _jpeg_size(data: bytes) -> tuple[int, int]:
    """``(width, height)`` from a JPEG header (simplejpeg.decode_jpeg_header)."""
    import simplejpeg

    h, w, _, _ = simplejpeg.decode_jpeg_header(data)
    return int(w), int(h)


class PixelFolder:
    """torchvision's ImageFolder listing of ``root`` whose items are ``(pixels uint8 [3, crop, crop], class)``:
    each file read, decoded (``decode``: ``DECODERS``) and resized/cropped by ``pixel_transform``, each stage
    timed into ``clock``. ``samples``/``classes``/``targets`` are ImageFolder's (sorted class folders, sorted
    files). Raises ConfigError for a bad ``decode``; a damaged file raises in ``__getitem__`` (IndexedDataset
    names the sample id and the file)."""

    def __init__(self, root: str, resize_size: int, crop_size: int, decode: str = "pil",
                 clock: StageClock | None = None):
        from torchvision.datasets import ImageFolder

        check_decoder(decode)
        folder = ImageFolder(root, loader=lambda p: p)  # the listing only; files are read below
        self.root, self.samples, self.classes = str(root), folder.samples, folder.classes
        self.targets = [t for _, t in self.samples]
        self.resize_size, self.crop_size, self.decode = int(resize_size), int(crop_size), decode
        self.transform = pixel_transform(self.resize_size, self.crop_size)
        self.clock = clock or StageClock()
        # xxh3-64 of each file's bytes as read (int64 view), in shared memory: the workers fill it, a pixel cache
        # being built records its sources' digests from it (disteval.data.pixel_cache.PartWriter)
        self.source_digests = torch.zeros(len(self.samples), dtype=torch.int64).share_memory_()
        self.cache_writer: Any = None  # set by pixel_source.pixel_dataset when this run builds the cache

    def __len__(self) -> int:
        return len(self.samples)

    def read(self, index: int) -> bytes:
        """The bytes of sample ``index``'s file."""
        return Path(self.samples[index][0]).read_bytes()

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        t0 = time.perf_counter()
        data = self.read(index)
        if self.cache_writer is not None:
            import xxhash

            self.source_digests[index] = xxhash.xxh3_64_intdigest(data) - (1 << 63)
        t1 = time.perf_counter()
        img = decode_image(data, self.decode, self.resize_size)
        t2 = time.perf_counter()
        x = self.transform(img)
        t3 = time.perf_counter()
        self.clock.add((t1 - t0, t2 - t1, t3 - t2))
        return x, self.samples[index][1]


    def host_tap(self, start: int, end: int) -> Any:
        """The pixel cache's writer of shard ``[start, end)`` when this run builds the cache, else None."""
        return self.cache_writer(self, start, end) if self.cache_writer is not None else None


class TimedCollate:
    """A loader's ``collate_fn`` (``collate``: torch's default when None) whose seconds go to ``clock``'s ``collate``
    stage, in the worker that collates (pickles by reference: the workers are forked)."""

    def __init__(self, clock: StageClock, collate: Any = None):
        from torch.utils.data import default_collate

        self.clock, self.collate = clock, collate or default_collate

    def __call__(self, items: list) -> Any:
        t = time.perf_counter()
        out = self.collate(items)
        self.clock.add_collate(time.perf_counter() - t)
        return out


class PixelNormalizer:
    """uint8 pixels [B, 3, H, W] (any device) -> float32 ``(x / 255 - mean) / std`` on that device, the float32
    operations of torchvision's ``ConvertImageDtype(torch.float32)`` then ``Normalize(mean, std)`` in their order
    (``x.to(float32) / 255``, ``sub_(mean)``, ``div_(std)``), so each value is bit-identical to the per-image
    host transform's. mean, std: 3 floats each (of [0, 1] values). Other inputs pass through unchanged."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]):
        self.mean = torch.as_tensor(list(mean), dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.as_tensor(list(std), dtype=torch.float32).view(1, -1, 1, 1)
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.dtype != torch.uint8:
            return x
        dev = x.device
        if dev not in self._on:
            self._on[dev] = (self.mean.to(dev), self.std.to(dev))
        mean, std = self._on[dev]
        squeeze = x.ndim == 3
        y = x[None] if squeeze else x
        y = (y.to(torch.float32) / 255.0).sub_(mean).div_(std)
        return y[0] if squeeze else y
