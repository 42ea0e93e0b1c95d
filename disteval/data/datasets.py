"""Datasets of disteval. Every item is ``(input, target, sample_id)``: the id is the item's index in [0, N).

- ``digits``: scikit-learn's bundled 8x8 digits; split ``test`` is the held-out 30 % (stratified,
  random_state=0), ``train`` the rest. Inputs float32 [1, 8, 8] in [0, 1].
- ``fashion_mnist``: the idx files (``t10k-*`` for test, ``train-*`` for train, optionally .gz) in
  ``data.root`` or ``data.root/FashionMNIST/raw``; ``data.download=true`` lets the driver fetch them once
  with torchvision's downloader (``prepare_data``).
  Inputs float32 [1, 28, 28] in [0, 1].
- ``imagefolder``: torchvision ImageFolder at ``data.root`` with the ImageNet eval transform
  (resize short side to ``resize_size``, bilinear, antialias; center crop ``crop_size``; normalise); with
  ``data.decode_on_device=true`` the items are the files' bytes and the step decodes them on the model's
  device (``disteval.data.device_decode``).
"""
from __future__ import annotations

import gzip
import math
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from disteval.data.cache import cache_root, read_npz, say, write_npz
from disteval.data.device_decode import EncodedImageFolder
from disteval.data.pixel_source import pixel_dataset
from disteval.errors import ConfigError, DataError

DATASETS = ("digits", "fashion_mnist", "imagefolder", "webdataset")
STREAMED = ("webdataset",)  # read as a stream of tar shards planned per rank (disteval.data.streaming)


def is_streamed(data: Any) -> bool:
    """Whether the ``data`` config names a streamed dataset (no random access: no device mesh, no canary)."""
    return str(data.name) in STREAMED
DIGITS_TEST_FRACTION = 0.3
_IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class IndexedDataset(Dataset):
    """Wraps a map-style dataset of ``(input, target)`` so items are ``(input, target, sample_id)`` (target: a
    class index int, or a multi-hot int64 tensor [C] for multi-label datasets).

    ``limit`` keeps only the first ``limit`` items. A failure to load item ``i`` is re-raised as
    DataError naming the sample id (and the file, when the base dataset has ``samples``).
    """

    def __init__(self, base: Dataset, limit: int | None = None):
        self.base = base
        n = len(base)  # type: ignore[arg-type]
        self.num_samples = n if limit is None else min(n, limit)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int):
        try:
            x, y = self.base[index]
        except Exception as exc:  # noqa: BLE001 - re-raised with the sample named
            where = ""
            samples = getattr(self.base, "samples", None)
            if samples is not None:
                cached = hasattr(self.base, "cache")  # CachedPixels: the file's pixels, read from the pixel cache
                where = f" ({'the pixels of ' if cached else ''}file {samples[index][0]}{', from the pixel cache' if cached else ''})"
            raise DataError(f"cannot load sample id {index}{where}: {type(exc).__name__}: {exc}") from exc
        if isinstance(y, torch.Tensor) and y.ndim > 0:  # multi-hot targets [C] of a multi-label dataset
            return x, y.long(), index
        return x, int(y), index

    @property
    def in_memory(self) -> bool:
        """Whether ``fetch_batch`` can cut batches straight out of the base's tensors (a TensorDataset of
        inputs [N, ...] and class indices [N]: digits, fashion_mnist)."""
        base = self.base
        if hasattr(base, "fetch_batch"):  # a pixel cache (disteval.data.pixel_cache.CachedPixels)
            return True
        return (isinstance(base, TensorDataset) and len(base.tensors) == 2 and base.tensors[1].ndim == 1
                and not base.tensors[1].dtype.is_floating_point)

    @property
    def stage_clock(self) -> Any:
        """The base's ``StageClock`` (seconds of its read/decode/transform/collate stages; ``disteval.data.pixels``), or
        None."""
        return getattr(self.base, "clock", None)

    def host_tap(self, start: int, end: int) -> Any:
        """The base's tap on the loop's host batches of shard ``[start, end)`` (a pixel cache being built:
        ``disteval.data.pixel_cache``), or None."""
        tap = getattr(self.base, "host_tap", None)
        return tap(start, end) if tap is not None else None

    def fetch_batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(inputs, targets, sample_ids)`` of ``indices`` at once, equal to the default collation of the items
        (inputs stacked, targets and ids int64): one slice copy when the indices are one ascending run, else one
        gather. A copy, never a view, so a model that writes into its input cannot change the dataset. Only for
        ``in_memory`` datasets."""
        if hasattr(self.base, "fetch_batch"):
            return self.base.fetch_batch(indices)
        x, y = self.base.tensors
        lo, n = indices[0], len(indices)
        if indices[-1] - lo + 1 == n and all(b == a + 1 for a, b in zip(indices, indices[1:])):
            return x[lo:lo + n].clone(), y[lo:lo + n].long(), torch.arange(lo, lo + n, dtype=torch.int64)
        idx = torch.tensor(indices, dtype=torch.int64)
        return x.index_select(0, idx), y.index_select(0, idx).long(), idx


def _digits_split(split: str) -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits split (pixels float64 [N, 64] in 0..16, labels [N])."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=DIGITS_TEST_FRACTION, random_state=0, stratify=y)
    return (x_te, y_te) if split == "test" else (x_tr, y_tr)


def _digits_cache(split: str) -> Path | None:
    """Where the digits split is cached (``disteval.data.cache``: ``DISTEVAL_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/disteval`` or ``~/.cache/disteval``), one file per scikit-learn version and split. None
    when the version is unknown."""
    import importlib.metadata

    try:
        version = importlib.metadata.version("scikit-learn")
    except importlib.metadata.PackageNotFoundError:
        return None
    return cache_root() / f"digits-sklearn{version}-{split}-test{DIGITS_TEST_FRACTION}-seed0.npz"


def _digits_shapes(arrays: dict) -> str | None:
    """What is wrong with a digits cache file's arrays (``x`` [N, 64], ``y`` [N]), None when nothing."""
    x, y = arrays.get("x"), arrays.get("y")
    if x is None or y is None:
        return f"arrays {sorted(arrays)}, not x and y"
    if x.ndim != 2 or x.shape[1] != 64 or y.shape != (x.shape[0],):
        return f"x of shape {x.shape} and y of shape {y.shape}, not [N, 64] and [N]"
    return None


def _digits_arrays(split: str, notes: list[str] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The split from the cache, else from scikit-learn (whose import costs about a second in every rank),
    then cached (atomic rename; an unwritable cache is skipped). The cache holds exactly scikit-learn's
    arrays for its version, so the data never depend on it. A corrupt cache file (truncated, garbage, wrong
    arrays) is named and rebuilt: said in ``notes`` (the driver's preflight) or else in the rank's log."""
    path = _digits_cache(split)
    arrays, problem = read_npz(path, _digits_shapes) if path is not None else (None, None)
    if arrays is not None:
        return arrays["x"], arrays["y"]
    xs, ys = _digits_split(split)
    failed = write_npz(path, x=xs, y=ys) if path is not None else None
    if problem:
        done = f"could not rebuild it ({failed}): scikit-learn's split is used" if failed else \
            "rebuilt it from scikit-learn"
        say(f"the digits cache file {path} is corrupt or unreadable ({problem}): {done} (a cache file is "
            "disposable; DISTEVAL_CACHE_DIR sets where the cache lives)", notes)
    return xs, ys


def _digits(split: str) -> TensorDataset:
    if split not in ("train", "test"):
        raise ConfigError("data.split", f"digits has splits 'train' and 'test', not {split!r}")
    xs, ys = _digits_arrays(split)
    images = torch.from_numpy((xs / 16.0).astype(np.float32)).reshape(-1, 1, 8, 8)
    return TensorDataset(images, torch.from_numpy(ys.astype(np.int64)))


def _fashion_files(root: Path, split: str) -> tuple[Path, Path] | None:
    prefix = {"test": "t10k", "train": "train"}[split]
    for folder in (root, root / "FashionMNIST" / "raw"):
        found = []
        for kind in ("images-idx3-ubyte", "labels-idx1-ubyte"):
            cands = [folder / f"{prefix}-{kind}", folder / f"{prefix}-{kind}.gz"]
            hit = next((c for c in cands if c.is_file()), None)
            found.append(hit)
        if all(found):
            return found[0], found[1]
    return None


def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (the MNIST format: big-endian magic 0x0000 <dtype 0x08> <ndim>, dims, uint8 data),
    gzip-compressed when the name ends in .gz. Raises DataError naming the file when it is malformed."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError, zlib.error) as exc:  # unreadable, truncated or corrupt gzip
        raise DataError(f"cannot read {path}: {type(exc).__name__}: {exc}") from exc
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise DataError(f"{path} is not a uint8 IDX file (bad magic {raw[:4].hex()})")
    ndim = raw[3]
    offset = 4 + 4 * ndim
    if len(raw) < offset:
        raise DataError(f"{path}: truncated header ({len(raw)} bytes for {ndim} dimensions)")
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    if len(raw) - offset != math.prod(dims):
        raise DataError(f"{path}: header says {dims} but holds {len(raw) - offset} bytes of data")
    return np.frombuffer(raw, dtype=np.uint8, offset=offset).reshape(dims)


def _fashion_mnist(root: str | None, split: str) -> TensorDataset:
    if split not in ("train", "test"):
        raise ConfigError("data.split", f"fashion_mnist has splits 'train' and 'test', not {split!r}")
    if root is None:
        raise ConfigError("data.root", "fashion_mnist needs data.root (the folder with t10k-images-idx3-ubyte)")
    files = _fashion_files(Path(root), split)
    if files is None:
        raise ConfigError("data.root", f"no Fashion-MNIST {split} idx files in {root!r} (install Debian's "
                          "dataset-fashion-mnist, or set data.download=true where there is internet)")
    else:
        images, labels = read_idx(files[0]), read_idx(files[1])
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise DataError(f"{files[0]} and {files[1]} disagree: images {images.shape}, labels {labels.shape}")
    x = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)
    return TensorDataset(x, torch.from_numpy(labels.astype(np.int64)))


def imagenet_eval_transform(resize_size: int, crop_size: int, mean, std):
    """The ImageNet eval transform of torchvision's classification weights (``ImageClassification`` preset):
    bilinear resize of the short side with antialias, center crop, float in [0, 1], normalise."""
    from torchvision import transforms as T

    return T.Compose([
        T.Resize(resize_size, interpolation=T.InterpolationMode.BILINEAR, antialias=True),
        T.CenterCrop(crop_size),
        T.PILToTensor(),
        T.ConvertImageDtype(torch.float32),
        T.Normalize(mean=list(mean), std=list(std)),
    ])


def imagefolder_classes(root: str) -> list[str]:
    """Sorted class folder names under ``root`` (ImageFolder's class order). Raises ConfigError when the
    root is missing, unreadable, or holds no class folder with images."""
    path = Path(root)
    if not path.is_dir():
        raise ConfigError("data.root", f"{root!r} {'is not a directory' if path.exists() else 'does not exist'}")
    try:
        classes = sorted(e.name for e in path.iterdir() if e.is_dir())
    except OSError as exc:
        raise ConfigError("data.root", f"cannot read {root!r}: {exc}") from exc
    if not classes:
        raise ConfigError("data.root", f"{root!r} holds no class sub-folders (expected root/<class>/<image>)")
    for c in classes:
        try:
            has_image = any(f.suffix.lower() in _IMG_EXTENSIONS for f in (path / c).iterdir())
        except OSError as exc:
            raise ConfigError("data.root", f"cannot read class folder {path / c}: {exc}") from exc
        if not has_image:
            raise ConfigError("data.root", f"class folder {path / c} holds no images ({', '.join(_IMG_EXTENSIONS)})")
    return classes


def check_data_root(data: Any) -> None:
    """Preflight: fail before any rank starts when ``data.root`` is missing or empty. Raises ConfigError."""
    if data.name not in DATASETS:
        raise ConfigError("data.name", f"unknown dataset {data.name!r}; available: "
                          f"{', '.join(DATASETS + ('coco', 'coco_replay'))}")
    splits = {"digits": ("train", "test"), "fashion_mnist": ("train", "test")}.get(data.name)
    if splits and data.split not in splits:
        raise ConfigError("data.split", f"{data.name} has splits {list(splits)}, not {data.split!r}")
    if data.name == "digits":
        return
    if data.name == "webdataset":
        from disteval.data.streaming import ensure_index

        ensure_index(data)
        return
    if data.root is None:
        raise ConfigError("data.root", f"dataset {data.name} needs data.root=PATH")
    root = Path(data.root)
    if data.name == "fashion_mnist":
        if data.download:
            return
        if not root.is_dir():
            what = "is not a directory" if root.exists() else "does not exist"
            raise ConfigError("data.root", f"{data.root!r} {what} (Fashion-MNIST: install Debian's "
                              "dataset-fashion-mnist or set data.download=true)")
        if _fashion_files(root, data.split) is None:
            raise ConfigError("data.root", f"{data.root!r} has no Fashion-MNIST {data.split} idx files "
                              "(t10k-images-idx3-ubyte[.gz], t10k-labels-idx1-ubyte[.gz])")
    else:
        imagefolder_classes(data.root)


def build_dataset(data: Any) -> tuple[IndexedDataset, int]:
    """Build the dataset described by the ``data`` config node. Returns ``(dataset, num_classes)``.

    Raises ConfigError (bad key values) or DataError (bad files)."""
    if data.name == "webdataset":
        from disteval.data.streaming import stream_source

        return stream_source(data), data.num_classes  # type: ignore[return-value]
    check_data_root(data)
    if data.name == "digits":
        base, num_classes = _digits(data.split), 10
    elif data.name == "fashion_mnist":
        base, num_classes = _fashion_mnist(data.root, data.split), 10
    elif data.decode_on_device:  # bytes only: the step decodes on the model's device
        base = EncodedImageFolder(data.root)
        num_classes = len(base.classes)
    else:  # uint8 pixels, from the files or the pixel cache; the step normalises them on the device
        base = pixel_dataset(data)
        num_classes = len(base.classes)
    return IndexedDataset(base, data.limit), num_classes


def input_shape(data: Any) -> tuple[int, int, int]:
    """Shape (C, H, W) of one input of the configured dataset (preflight; webdataset: its first sample)."""
    if data.name == "webdataset":
        from disteval.data.streaming import stream_source

        return stream_source(data).first_sample_shape()  # type: ignore[return-value]
    return {"digits": (1, 8, 8), "fashion_mnist": (1, 28, 28)}.get(data.name, (3, data.crop_size, data.crop_size))


def prepare_data(data: Any, notes: list[str] | None = None) -> None:
    """Driver-side, once: digits' cache file checked (a corrupt one rebuilt, said in ``notes``) or written, so
    the ranks find it; with data.download=true and no Fashion-MNIST files in data.root, download them with
    torchvision (needs internet). Raises ConfigError naming data.root when that fails."""
    if data.name == "digits":
        _digits_arrays(str(data.split), notes)
        return
    if data.name != "fashion_mnist" or not data.download or _fashion_files(Path(data.root), data.split):
        return
    import torchvision

    try:
        torchvision.datasets.FashionMNIST(data.root, train=data.split == "train", download=True)
    except Exception as exc:  # noqa: BLE001 - offline machines land here
        raise ConfigError("data.root", f"data.download=true could not fetch Fashion-MNIST into {data.root!r} "
                          f"({type(exc).__name__}: {exc}); install Debian's dataset-fashion-mnist instead") from exc


def dataset_num_classes(data: Any) -> int:
    """Class count of the configured dataset without loading it (preflight)."""
    if data.name in ("digits", "fashion_mnist"):
        return 10
    if data.name == "webdataset":
        return data.num_classes
    return len(imagefolder_classes(data.root))
