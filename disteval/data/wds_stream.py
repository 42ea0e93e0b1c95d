"""Reading planned ranges of WebDataset tar shards: an IterableDataset whose every (rank, worker) consumer
reads only its own samples (``stream_plan``), with webdataset's tar iteration (``tar_file_iterator``),
grouping (``group_by_keys``) and decoding (``autodecode.Decoder``), and yields whole batches.

Items are batches (use ``DataLoader(dataset, batch_size=None, num_workers=K)``), ``StreamBatch`` tuples of
``inputs`` (float32 [b, C, H, W] in [0, 1] for images decoded as ``l8``/``rgb8``, or whatever ``transform``
returns, stacked; None when every sample of the batch was skipped), ``targets`` (int64 [b] from ``.cls``,
or a list of b str from ``.txt``), ``sample_ids`` (int64 [b], global positions; ``sample_name`` maps one to
``(url, key)``), ``skipped`` (int64 [s], positions skipped by ``on_decode_error=skip``), ``worker`` (int) and
``batch`` (the global batch index when batch-aligned, else the position of the consumer's batch's first
sample: unique in the run either way).

Batches are the planner's: batch-aligned plans yield global batch b as positions ``[bB, min((b+1)B, N))``
minus skipped samples, so a skipped sample never moves another one into a different batch.

Errors (DataError): a sample that fails to decode or lacks its image or target field names the shard, key
and field (unless ``on_decode_error="skip"``); a truncated or unreadable shard, or one whose members
differ from the index, names the shard; images of different shapes in one batch name each shape with the shard
and key of its first sample. Nothing hangs: local shards are plain files, read to their end.
"""
from __future__ import annotations

import bisect

from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from disteval.data.index import ShardInfo, local_path
from disteval.data.stream_plan import ConsumerPlan, ShardRange
from disteval.errors import DataError

IMAGE_FIELDS = ("jpg", "jpeg", "png", "webp")
TARGET_FIELDS = ("cls", "txt")
DECODE_ERRORS = ("raise", "skip")

__all__ = ["DECODE_ERRORS", "CountingFile", "SampleFormat", "ShardStream", "StreamBatch", "read_range", "sample_name",
           "stack_inputs", "to_float_chw"]


class _EndOfRange(Exception):
    """Raised by the member filter at the first member after the consumer's range (before its data is read)."""


class CountingFile:
    """A read-only binary file that counts the bytes it returned (``bytes_read``, int)."""

    def __init__(self, f):
        self.f, self.bytes_read = f, 0

    def read(self, size: int = -1) -> bytes:
        data = self.f.read(size)
        self.bytes_read += len(data)
        return data

    def close(self) -> None:
        self.f.close()


def to_float_chw(image: np.ndarray) -> torch.Tensor:
    """uint8 [H, W] or [H, W, C] -> float32 [C, H, W] in [0, 1] (``x / 255`` in float32, the same expression as
    the map-style datasets, so both give the same bits)."""
    x = np.asarray(image).astype(np.float32) / 255.0
    if x.ndim == 2:
        x = x[None]
    else:
        x = np.ascontiguousarray(x.transpose(2, 0, 1))
    return torch.from_numpy(x)


def stack_inputs(inputs: list[torch.Tensor], names: list[tuple[str, str]], batch: str) -> torch.Tensor:
    """``torch.stack`` of one batch's inputs (``names``: each one's ``(shard url, key)``). Raises DataError when
    their shapes differ, naming each shape, how many samples have it and the first one's shard and key."""
    shapes: dict[tuple, list] = {}
    for x, name in zip(inputs, names):
        shapes.setdefault(tuple(getattr(x, "shape", ())), [0, name])[0] += 1
    if len(shapes) > 1:
        listed = ", ".join(f"{shape} for {n} sample{'s' if n != 1 else ''} (first: shard {url}, key {key!r})"
                           for shape, (n, (url, key)) in shapes.items())
        raise DataError(f"{batch}: images of different shapes cannot be stacked into one batch: {listed}; every "
                        "image of a batch must have one shape: write the shards with the images resized or "
                        "cropped to one size (the model's input size)")
    return torch.stack(inputs)


def source_bytes(raw: dict, target_field: str) -> bytes:
    """The bytes a raw sample's input and target come from, whose xxh3-64 a pixel cache records: its image
    field's bytes, a NUL, its target field's bytes (a missing field counts as empty)."""
    image = next((raw[f] for f in IMAGE_FIELDS if f in raw), b"")
    return bytes(image) + b"\0" + bytes(raw.get(target_field, b""))


def _digest(raw: dict, target_field: str) -> int:
    import xxhash

    return xxhash.xxh3_64_intdigest(source_bytes(raw, target_field)) - (1 << 63)


def sample_name(shards: Sequence[ShardInfo], starts: Sequence[int], position: int) -> tuple[str, str]:
    """``(url, key)`` of a global position."""
    from disteval.data.stream_plan import locate

    s, i = locate(starts, position)
    return shards[s].url, shards[s].keys[i]


def _seekable(url: str) -> bool:
    """Local files seek; http(s) URLs are asked for a byte range; other schemes are read from the start."""
    return local_path(url) is not None or url.startswith(("http://", "https://"))


def _open(url: str, offset: int | None) -> CountingFile:
    """The shard from byte ``offset`` (None or 0: from the start): a local file, curl with ``-r OFFSET-``
    (argument list, no shell) for http(s), else webdataset's ``gopen``."""
    path = local_path(url)
    try:
        if path is not None:
            f = open(path, "rb")
            if offset:
                f.seek(offset)
        elif offset:
            from webdataset.gopen import Pipe

            f = Pipe(["curl", "--connect-timeout", "30", "--retry", "30", "--retry-delay", "2", "-f", "-s", "-L",
                      "-r", f"{offset}-", url], mode="rb", ignore_status=[141, 23])
        else:
            from webdataset.gopen import gopen

            f = gopen(url)
    except OSError as exc:
        raise DataError(f"shard {url} is unreadable: {exc}") from exc
    return CountingFile(f)


def read_range(shard: ShardInfo, rng: ShardRange, counter: list[int] | None = None) -> Iterator[dict]:
    """Raw samples (webdataset dicts: ``__key__``, ``__url__``, one bytes value per field) of ``rng`` in tar
    order. Starts at the index's byte offset of the range when it has one and the URL allows it (local file,
    http/https), else reads and discards the members of the samples before the range; stops before reading the data
    of the first member after it. ``counter[0]`` is
    increased by the bytes read from the shard. Raises DataError naming the shard when it is truncated,
    unreadable or disagrees with the index."""
    from webdataset.tariterators import base_plus_ext, group_by_keys, tar_file_iterator

    wanted = shard.keys[rng.first:rng.stop]
    offset = shard.offsets[rng.first] if shard.offsets is not None and _seekable(shard.url) else None
    wanted_set, before = set(wanted), set(shard.keys[:rng.first]) if offset is None else set()
    first_member, problem = [True], []

    def select(fname: str) -> bool:
        key = base_plus_ext(fname)[0]
        if first_member[0] and offset and key is not None:
            first_member[0] = False
            if key != wanted[0]:  # a changed shard, or a server that sent the whole file for a byte range
                problem.append(f"shard {shard.url}: at byte {offset} the index has sample {wanted[0]!r}, the shard "
                               f"{key!r} (the shard changed since indexing, or the server ignored the byte range)")
                raise _EndOfRange(key)  # (tar_file_iterator appends its stream to an exception's message)
        if key in wanted_set:
            return True
        if key in before or key is None:
            return False
        raise _EndOfRange(key)

    f = _open(shard.url, offset)

    def members() -> Iterator[dict]:
        try:
            for m in tar_file_iterator(f, select_files=select):
                m["__url__"] = shard.url
                yield m
        except _EndOfRange:
            if problem:
                raise DataError(problem[0]) from None
            return
        except Exception as exc:  # tarfile.ReadError, OSError, EOFError from a cut or corrupt shard
            raise DataError(f"shard {shard.url} is truncated or unreadable at sample "
                            f"{rng.first}..{rng.stop}: {type(exc).__name__}: {exc}") from exc

    got = 0
    try:
        for sample in group_by_keys(members()):
            if got >= len(wanted) or sample["__key__"] != wanted[got]:
                raise DataError(f"shard {shard.url} differs from its index: sample {rng.first + got} has key "
                                f"{sample['__key__']!r}, the index says "
                                f"{wanted[got] if got < len(wanted) else 'none'!r} (rebuild the index)")
            got += 1
            yield sample
            if got == len(wanted):
                break
    finally:
        if counter is not None:
            counter[0] += f.bytes_read
        f.close()
    if got != len(wanted):
        raise DataError(f"shard {shard.url} is truncated: it ended after {rng.first + got} samples, the index "
                        f"has {shard.num_samples}")


class StreamBatch(NamedTuple):
    """One batch of a ShardStream (fields in the module docstring). A NamedTuple: torch's DataLoader carries
    it through worker processes and pinning as it is, and the loop tells it from a map-style batch by type."""
    inputs: torch.Tensor | None
    targets: Any
    sample_ids: torch.Tensor
    skipped: torch.Tensor
    worker: int
    batch: int
    digests: Any = None  # int64 [b]: xxh3-64 of each sample's ``source_bytes`` (a pixel cache being built), else None
    skipped_digests: Any = None  # int64 [s]: the same of each skipped sample, else None


@dataclass(frozen=True)
class SampleFormat:
    """How a raw sample becomes ``(input, target)``.

    image_mode: webdataset imagespec, ``l8`` (grey uint8 [H, W]) or ``rgb8`` (uint8 [H, W, 3]), or ``pil``.
    transform: decoded image -> input tensor; None means ``to_float_chw`` (float32 [C, H, W] in [0, 1]).
    target_field: ``cls`` (int class index) or ``txt`` (str caption, image-text pairs).
    on_decode_error: ``raise`` (DataError naming shard, key and field) or ``skip`` (counted in ``skipped``).
    source_digests: batches carry the xxh3-64 of each sample's ``source_bytes`` (``StreamBatch.digests``,
    ``skipped_digests``).
    Raises ValueError for an unknown target field or policy.
    """
    image_mode: str = "rgb8"
    transform: Callable[[Any], torch.Tensor] | None = None
    target_field: str = "cls"
    on_decode_error: str = "raise"
    source_digests: bool = False

    def __post_init__(self):
        if self.on_decode_error not in DECODE_ERRORS:
            raise ValueError(f"on_decode_error must be one of {DECODE_ERRORS}, not {self.on_decode_error!r}")
        if self.target_field not in TARGET_FIELDS:
            raise ValueError(f"target_field must be one of {TARGET_FIELDS}, not {self.target_field!r}")


class ShardStream(IterableDataset):
    """The batches of this rank's consumers (``plans``: one per loader worker, from ``plan_rank``).

    Args:
        shards: the index (``load_index``), in shard order.
        plans: ``plan_rank(...)`` for this rank; worker k of the DataLoader reads ``plans[k]``.
        batch_size: B. With batch-aligned plans (``plan.batch_size`` set) batches are global batches.
        fmt: decoding and the decode-error policy (SampleFormat).
    """

    def __init__(self, shards: Sequence[ShardInfo], plans: Sequence[ConsumerPlan], batch_size: int,
                 fmt: SampleFormat = SampleFormat()):
        self.shards, self.plans, self.batch_size = list(shards), list(plans), batch_size
        self.fmt = fmt
        self.image_mode, self.transform = fmt.image_mode, fmt.transform or to_float_chw
        self.target_field, self.on_decode_error = fmt.target_field, fmt.on_decode_error
        self.bytes_read = [0]  # in the process that iterates (a worker's count stays in the worker)

    def __iter__(self) -> Iterator[StreamBatch]:
        info = get_worker_info()
        workers = 1 if info is None else info.num_workers
        if workers != len(self.plans):
            raise ValueError(f"the DataLoader has {workers} workers, the plan {len(self.plans)}")
        return self.iter_worker(0 if info is None else info.id)

    def _decoder(self):
        from webdataset.autodecode import Decoder, imagehandler

        return Decoder([imagehandler(self.image_mode)])

    def _item(self, decoder, raw: dict) -> tuple[torch.Tensor, Any]:
        """(input, target) of one raw sample. Raises DataError naming shard, key and field."""
        from webdataset.autodecode import DecodingError

        where = f"shard {raw['__url__']}, key {raw['__key__']!r}"
        image_field = next((f for f in IMAGE_FIELDS if f in raw), None)
        if image_field is None:
            raise DataError(f"{where}: no image field (one of {', '.join(IMAGE_FIELDS)}); has "
                            f"{sorted(k for k in raw if not k.startswith('__'))}")
        if self.target_field not in raw:
            raise DataError(f"{where}: no field {self.target_field!r}")
        fields = {"__key__": raw["__key__"], "__url__": raw["__url__"], image_field: raw[image_field],
                  self.target_field: raw[self.target_field]}
        try:
            sample = decoder.decode(fields)
        except DecodingError as exc:
            cause = exc.__cause__
            raise DataError(f"{where}: field {exc.k!r} does not decode: {type(cause).__name__}: {cause}") from exc
        target = sample[self.target_field]
        if self.target_field == "txt" and not isinstance(target, str):
            target = bytes(target).decode("utf-8")
        return self.transform(sample[image_field]), target

    def items(self, plan: ConsumerPlan) -> Iterator[tuple[int, tuple | None, int | None]]:
        """``(position, (input, target, (url, key)), digest)`` of each sample of ``plan`` in order; the item is
        None for a sample skipped by ``on_decode_error=skip``; the digest (``source_bytes``' xxh3-64, int64) is
        None unless ``fmt.source_digests``."""
        decoder = self._decoder()
        digests = self.fmt.source_digests
        for rng in plan.ranges:
            for i, raw in enumerate(read_range(self.shards[rng.shard], rng, self.bytes_read)):
                pos = rng.position + i
                digest = _digest(raw, self.target_field) if digests else None
                try:
                    x, y = self._item(decoder, raw)
                except DataError:
                    if self.on_decode_error == "raise":
                        raise
                    yield pos, None, digest
                    continue
                yield pos, (x, y, (raw["__url__"], raw["__key__"])), digest

    def iter_worker(self, worker: int) -> Iterator[StreamBatch]:
        """The batches of consumer ``worker`` of this rank (callable without a DataLoader: tests simulate
        every (rank, worker) consumer in one process this way)."""
        plan = self.plans[worker]
        b, aligned, origin = self.batch_size, plan.batch_size is not None, plan.start
        pending: list[tuple[int, Any, Any, tuple[str, str], Any]] = []  # (position, input, target, (url, key), digest)
        skipped: list[int] = []
        skipped_digests: list[int | None] = []
        current = None  # the batch index of ``pending`` / ``skipped``

        def emit():
            nonlocal pending, skipped, skipped_digests
            where = f"global batch {current}" if aligned else f"the batch from sample position {current}"
            digests = [d for *_, d in pending]
            out = StreamBatch(stack_inputs([x for _, x, *_ in pending], [n for *_, n, _ in pending], where)
                              if pending else None,
                              (torch.tensor([y for _, _, y, *_ in pending], dtype=torch.int64)
                               if self.target_field == "cls" else [y for _, _, y, *_ in pending]),
                              torch.tensor([p for p, *_ in pending], dtype=torch.int64),
                              torch.tensor(skipped, dtype=torch.int64), worker, current,
                              torch.tensor(digests, dtype=torch.int64) if pending and digests[0] is not None else None,
                              torch.tensor(skipped_digests, dtype=torch.int64)
                              if skipped and skipped_digests[0] is not None else None)
            pending, skipped, skipped_digests = [], [], []
            return out

        span_starts = [a for a, _ in plan.spans] if plan.given else None  # each given span is one batch
        for pos, item, digest in self.items(plan):
            if aligned:
                batch = pos // b
            else:
                batch = span_starts[bisect.bisect_right(span_starts, pos) - 1] if plan.given else \
                    origin + (pos - origin) // b * b
            if batch != current:
                if pending or skipped:
                    yield emit()
                current = batch
            if item is None:
                skipped.append(pos)
                skipped_digests.append(digest)
            else:
                pending.append((pos, *item, digest))
        if pending or skipped:
            yield emit()
