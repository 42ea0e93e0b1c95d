"""Structured-config schemas (Hydra ConfigStore) and where conf/ is found.

The schema is registered as ``disteval_schema`` and is the first entry of ``conf/config.yaml``'s defaults
list, so every group file (model/, data/, ...) is merged onto a typed node: an unknown key or a value of the
wrong type fails at composition with Hydra's error naming the full key (e.g. ``Key 'foo' not in
'ModelConfig' full_key: model.foo``).
"""
from __future__ import annotations

import importlib.util
import os
from datetime import datetime
from dataclasses import dataclass, field, fields, make_dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from disteval.common.allocator import POLICIES as ALLOCATORS
from disteval.common.checks import at_least as _at_least
from disteval.common.checks import finite_positive as _finite_positive
from disteval.common.closed_sets import COMPRESSION_MODES
from disteval.common.pipeline import DECODERS, PIXEL_CACHE_MODES
from disteval.errors import ConfigError
from disteval.options import OPTIONS
from disteval.precision import check_metric_dtypes

SAMPLERS = ("exact", "padded", "drop_last")
AGGREGATES = ("mean", "median", "sigma_clip")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _compile_backends() -> list[str]:
    """torch.compile's registered backends (``torch._dynamo.list_backends``, imported only when asked)."""
    import torch._dynamo  # noqa: PLC0415  (about 1.5 s: only for jobs that compile)

    return sorted(set(torch._dynamo.list_backends(exclude_tags=())) | {"inductor"})


MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week: beyond it a timeout is a typo (and 1e300 overflows the backends)


class ModelDtype(StrEnum):
    """Compute dtype of the model's forward pass (autocast); metric states never use it."""

    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class Backend(StrEnum):
    """torch.distributed backend; ``auto`` = nccl when the ranks use CUDA devices, else gloo."""

    auto = "auto"
    gloo = "gloo"
    nccl = "nccl"


Compression = StrEnum("Compression", [(mode, mode) for mode in COMPRESSION_MODES])
Compression.__doc__ = "Payload compression of gathered states (``disteval.common.closed_sets.COMPRESSION_MODES``)."


class Device(StrEnum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Heterogeneous(StrEnum):
    """``dist.heterogeneous``: what a fleet whose ranks compute different bits does (docs/metrics.md, Mixed hardware):
    ``warn`` runs and records the canary's measured drift (results.json ``canary``, a warning); ``refuse`` stops
    before the loop naming the ranks and nodes of each numeric class and the settings that differ; ``pin`` runs
    every rank on the lowest common kernel set (CPU: ``ATEN_CPU_CAPABILITY``; CUDA: TF32 off, highest matmul
    precision, deterministic algorithms, cuDNN benchmark off) and checks it with the canary."""

    warn = "warn"
    refuse = "refuse"
    pin = "pin"


class Mode(StrEnum):
    """``eval.mode``: ``bitwise`` (default) makes results.json's metrics bit-identical at every world size
    (batch-aligned shards, a fixed thread count, order-independent float sums); ``fast`` keeps sample-even
    shards, shares the cores among local ranks and all-reduces float sums (exact counts, floats within
    rounding)."""

    bitwise = "bitwise"
    fast = "fast"


@dataclass
class ModelConfig:
    """``model.*``: which network to evaluate.

    name: a reference CNN of this package (digits_cnn, fashion_cnn, vit_tiny) or any torchvision
    classification model name (vit_b_16, mobilenet_v2, resnet50, ...).
    weights: torchvision weights enum name (e.g. IMAGENET1K_V1; downloaded into torch.hub's cache by the
    driver, once) or ``shipped`` for the reference CNNs' checkpoints inside the package; null = random init.
    checkpoint: path to a plain state dict (loaded with ``torch.load(weights_only=True)``); takes
    precedence over ``weights``.
    checkpoints: several plain state dicts of the same architecture evaluated in one job over the same batches
    (a list of paths or glob patterns, or one pattern such as ``ckpts/epoch_*.pt``): one process start, one
    dataset read and one decode of every batch for all; results.json ``checkpoints`` holds one block per file
    and ``RUN_DIR/checkpoints/<name>/results.json`` each one's own results (``disteval.models.checkpoint_set``).
    num_classes: output classes; null = the dataset's class count (or the weights' categories).
    kwargs: extra keyword arguments for the model builder (e.g. image_size for a ViT).
    channels_last: convolutional models: parameters and 4-D inputs in ``torch.channels_last`` memory format
    (faster convolutions on GPUs with tensor cores; off by default, recorded in results.json ``compute``).
    """

    name: str = "digits_cnn"
    weights: Optional[str] = None
    checkpoint: Optional[str] = None
    checkpoints: Optional[Any] = None
    num_classes: Optional[int] = None
    kwargs: Dict[str, Any] = field(default_factory=dict)
    channels_last: bool = False


@dataclass
class DataConfig:
    """``data.*``: the evaluation dataset.

    name: the dataset, one of the data names the tasks claim (docs/configuration.md's task table, drawn from
    ``disteval.tasks.registered_tasks``). root: dataset directory (fashion_mnist:
    the idx files; imagefolder: one sub-folder per class; coco: the images). annotations: a COCO annotation
    JSON (coco, coco_replay); predictions: a COCO results JSON (coco_replay). split: which split (digits: the held-out ``test`` split).
    sampler: ``exact`` (disteval's unpadded contiguous shards; the default) or, only to reproduce other tools'
    numbers, ``padded`` / ``drop_last`` (torch's DistributedSampler, which repeats or drops samples so that every
    rank has the same count: such a run is marked inexact and its coverage problems are reported, not raised).
    limit: evaluate only the first ``limit`` samples (null = all). resize_size/crop_size/mean/std: the
    ImageNet-style eval transform of imagefolder data (resize short side, center crop, normalise).
    webdataset (streamed tar shards, ``disteval/data/streaming.py``): urls (brace pattern or list of shard
    paths/URLs), index (the shard index JSON; null: the driver builds and caches one), image_mode (``l8``
    grey or ``rgb8``), target_field (``cls``), on_decode_error (``raise`` or ``skip``: skipped samples are
    counted and listed in results.json), allow_pipe (accept ``pipe:`` URLs, which run shell commands),
    num_classes (the label count, when ``model.num_classes`` does not say).
    prefetch_factor: batches each loader worker prepares ahead (with num_workers > 0; torch's default is 2).
    persistent_workers: keep loader workers alive between the trials of ``eval.trials`` (with num_workers > 0).
    decode_on_device: imagefolder JPEGs: the loader reads bytes only and the step decodes and transforms each
    batch on the model's device (``torchvision.io.decode_jpeg``, nvJPEG on CUDA; off by default: its pixels
    are close to, not equal to, the host path's).
    decode: imagefolder images: ``pil`` (Pillow, torchvision's ImageFolder loader: the reference pixels) or
    ``turbo`` (libjpeg-turbo through simplejpeg with DCT-domain downscaling: faster, pixels may differ; results.json
    ``compute.decode``). Loader workers ship uint8 [3, crop, crop]; the step normalises on the model's device.
    cache (imagefolder and webdataset): ``none``, ``pixels`` (the exact decoded-pixel cache, ``disteval/data/pixel_cache.py``,
    ``disteval/data/stream_cache.py``: the first run
    builds it as it evaluates, later runs read uint8 crops from memory-mapped .npy parts, bit for bit the same
    pixels) or ``rebuild`` (discard that cache and build it again). cache_dir: where pixel caches live (null:
    ``$DISTEVAL_CACHE_DIR/pixels``, default ``~/.cache/disteval/pixels``). cache_verify: before a run reads the
    cache, ``stat`` (the default: size of every file, and the bytes of each file whose mtime changed, against
    the xxh3-64 digests recorded at build) or ``content`` (the bytes of every file: reads the whole dataset once).
    loader_timeout_s: seconds a loader worker may take to deliver one batch (with num_workers > 0; null: wait
    forever): past it the rank fails with a DataError instead of waiting on a stuck worker (a worker whose
    batch cannot be sent never delivers it, and the rank's heartbeat would go on).
    """

    name: str = "digits"
    root: Optional[str] = None
    split: str = "test"
    batch_size: int = 64
    num_workers: int = 0
    limit: Optional[int] = None
    download: bool = False
    resize_size: int = 256
    crop_size: int = 224
    mean: List[float] = field(default_factory=lambda: [0.485, 0.456, 0.406])
    std: List[float] = field(default_factory=lambda: [0.229, 0.224, 0.225])
    annotations: Optional[str] = None
    predictions: Optional[str] = None
    sampler: str = "exact"
    urls: Any = None
    index: Optional[str] = None
    image_mode: str = "rgb8"
    target_field: str = "cls"
    on_decode_error: str = "raise"
    allow_pipe: bool = False
    num_classes: Optional[int] = None
    prefetch_factor: int = 4
    persistent_workers: bool = True
    decode_on_device: bool = False
    decode: str = "pil"
    cache: str = "none"
    cache_dir: Optional[str] = None
    cache_verify: str = "stat"
    loader_timeout_s: Optional[float] = 600.0

    def validate(self) -> None:
        """Raises ConfigError naming the ``data.*`` key."""
        _at_least("data.batch_size", self.batch_size, 1)
        _at_least("data.prefetch_factor", self.prefetch_factor, 1)
        if self.loader_timeout_s is not None:
            _finite_positive("data.loader_timeout_s", self.loader_timeout_s)
        if self.decode_on_device and self.name != "imagefolder":
            raise ConfigError("data.decode_on_device", f"decodes imagefolder JPEGs on the device; data.name="
                              f"{self.name!r} has no encoded images to decode there")
        _at_least("data.limit", self.limit, 1, nullable=True)
        _at_least("data.num_workers", self.num_workers, 0)
        _check_pixels(self)
        if self.sampler not in SAMPLERS:
            raise ConfigError("data.sampler", f"{self.sampler!r} is not one of {list(SAMPLERS)}")
        if self.name == "webdataset":
            _check_webdataset(self)
        if self.name == "imagefolder":
            if self.resize_size < 1 or self.crop_size < 1:
                raise ConfigError("data.crop_size" if self.crop_size < 1 else "data.resize_size",
                                  f"must be >= 1 pixel, got {self.resize_size} / {self.crop_size}")
            if len(self.mean) != 3 or len(self.std) != 3 or any(v <= 0 for v in self.std):
                raise ConfigError("data.mean", f"data.mean and data.std need 3 values (RGB), std > 0; got "
                                  f"{list(self.mean)} / {list(self.std)}")


def _check_pixels(data: "DataConfig") -> None:
    """``data.decode`` / ``data.cache``: known values; the decoder for imagefolder data, the cache for imagefolder
    and webdataset data; neither with decode_on_device. Raises ConfigError naming the key."""
    if data.cache_verify not in ("stat", "content"):
        raise ConfigError("data.cache_verify", f"{data.cache_verify!r} is not one of ['stat', 'content']")
    if data.cache not in PIXEL_CACHE_MODES:
        raise ConfigError("data.cache", f"{data.cache!r} is not one of {list(PIXEL_CACHE_MODES)}")
    if data.decode not in DECODERS:
        raise ConfigError("data.decode", f"{data.decode!r} is not one of {list(DECODERS)}")
    if data.decode == "turbo" and importlib.util.find_spec("simplejpeg") is None:
        raise ConfigError("data.decode", "turbo needs simplejpeg (libjpeg-turbo): pip install 'disteval[turbo]'")
    for key, on, names in (("data.cache", data.cache != "none", ("imagefolder", "webdataset")),
                           ("data.decode", data.decode != "pil", ("imagefolder",))):
        if on and data.name not in names:
            raise ConfigError(key, f"applies to {' and '.join(names)} data (decoded images); data.name={data.name!r}")
        if on and data.decode_on_device:
            raise ConfigError(key, "data.decode_on_device=true decodes on the device: the host decoder and the "
                              "pixel cache do not apply; set one or the other")


def _check_webdataset(data: "DataConfig") -> None:
    """``data=webdataset`` keys. Raises ConfigError naming the key."""
    if data.urls is None:
        raise ConfigError("data.urls", "data=webdataset needs data.urls (a brace pattern or a list of shards)")
    choices = {"data.image_mode": (data.image_mode, ("l8", "rgb8")), "data.target_field": (data.target_field, ("cls",)),
               "data.on_decode_error": (data.on_decode_error, ("raise", "skip"))}
    for key, (value, allowed) in choices.items():
        if value not in allowed:
            raise ConfigError(key, f"{value!r} is not one of {list(allowed)}")
    _at_least("data.num_classes", data.num_classes, 1, nullable=True)
    if data.limit is not None:
        raise ConfigError("data.limit", "is not supported with data=webdataset (the shards are evaluated whole; "
                          "list fewer shards in data.urls)")


@dataclass
class PrecisionConfig:
    """``precision.*``: model compute precision. Metric states are always int64 counts and float64 sums;
    ``count_dtype``/``sum_dtype`` exist only so that a request for anything narrower is refused loudly."""

    model_dtype: ModelDtype = ModelDtype.fp32
    tf32: bool = False
    deterministic: bool = False
    count_dtype: str = "int64"
    sum_dtype: str = "float64"

    def validate(self) -> None:
        """Raises ConfigError for metric state dtypes narrower than int64 / float64."""
        check_metric_dtypes(self)


@dataclass
class CommunicationConfig:
    """``communication.*``: collectives. timeout_s (seconds) is the process group's timeout; every
    collective of the project runs under it. sync_timeout_s (seconds, null = timeout_s) replaces it for the
    final synchronisation, where ranks wait for the slowest one (``torch.distributed.set_timeout``).
    profile: ``none``, ``auto`` (pick from ``profiles`` by device name) or a profile's name; profiles: the
    hardware table in conf/communication/default.yaml (``name``, ``match`` substrings of the device name,
    and the communication.* defaults it sets); explicit overrides win.
    compression: none | lossless | fp16 | bf16 for gathered states; compress_states: which gather-states it
    applies to (null = all; fp16/bf16 round only states a metric declares compressible, naming an exact one
    is an error). async_threshold_bytes: payloads above it go in asynchronous chunks of chunk_bytes with at
    most max_in_flight outstanding (null = never chunk). progress_bytes: smaller payloads above it go in 8
    asynchronous pieces, each finished one recorded in the rank's status (``in_flight.bytes_done``: how far a
    hung collective got, and the link throughput the doctor reports; null = one call). reduce_scatter_min_bytes: sliceable sum-states
    above it (a large confusion matrix) are reduce-scattered and finished per slice (null = never)."""

    backend: Backend = Backend.auto
    timeout_s: float = 300.0
    sync_timeout_s: Optional[float] = None
    compression: Compression = Compression.none
    compress_states: Optional[List[str]] = None
    async_threshold_bytes: Optional[int] = 64 * 1024 * 1024
    chunk_bytes: int = 16 * 1024 * 1024
    progress_bytes: Optional[int] = 64 * 1024
    max_in_flight: int = 2
    reduce_scatter_min_bytes: Optional[int] = 64 * 1024 * 1024
    profile: str = "none"
    profiles: List[Dict[str, Any]] = field(default_factory=list)

    def validate(self) -> None:
        """Raises ConfigError naming the ``communication.*`` key."""
        _finite_positive("communication.timeout_s", self.timeout_s, most=MAX_TIMEOUT_S)
        _finite_positive("communication.sync_timeout_s", self.sync_timeout_s, nullable=True, most=MAX_TIMEOUT_S)
        _at_least("communication.async_threshold_bytes", self.async_threshold_bytes, 0, nullable=True)
        _at_least("communication.chunk_bytes", self.chunk_bytes, 1)
        _at_least("communication.progress_bytes", self.progress_bytes, 0, nullable=True)
        _at_least("communication.max_in_flight", self.max_in_flight, 1)
        _at_least("communication.reduce_scatter_min_bytes", self.reduce_scatter_min_bytes, 0, nullable=True)


@dataclass
class ParallelConfig:
    """``dist.parallel.*``: a device mesh of ``dp_replicate x dp_shard x tp`` ranks for models evaluated split
    over several devices (``disteval.comm.mesh``). The data is split over the data-parallel ranks
    (dp_replicate x dp_shard) only; tensor-parallel peers see the same batches. dp_shard > 1 shards the model's
    parameters with FSDP2, tp > 1 splits its layers by the architecture's plan
    (``disteval.models.parallel_plans``). All null (the default): no mesh, every rank data-parallel as
    always. A degree left null while another is set counts as 1, except that with both data-parallel degrees null
    dp_replicate takes what tp leaves (``degrees``); the product must be ``dist.world_size``."""

    dp_replicate: Optional[int] = None
    dp_shard: Optional[int] = None
    tp: Optional[int] = None

    @property
    def enabled(self) -> bool:
        return any(v is not None for v in (self.dp_replicate, self.dp_shard, self.tp))

    def degrees(self, world_size: int) -> tuple[int, int, int]:
        """(dp_replicate, dp_shard, tp) for ``world_size`` ranks: null as 1, except that when both data-parallel
        degrees are null, dp_replicate takes the rest, ``world_size // (tp)`` (torchtitan's data-parallel degree
        -1): ``dist.world_size=4 dist.parallel.tp=2`` is a 2 x 2 mesh."""
        rep, shard, tp = (1 if v is None else int(v) for v in (self.dp_replicate, self.dp_shard, self.tp))
        if self.dp_replicate is None and self.dp_shard is None and tp >= 1 and world_size % tp == 0:
            rep = world_size // tp
        return rep, shard, tp

    def validate(self, world_size: int) -> None:
        """Raises ConfigError naming ``dist.parallel`` and the values when a degree is < 1 or their product is
        not the world size."""
        for name in ("dp_replicate", "dp_shard", "tp"):
            _at_least(f"dist.parallel.{name}", getattr(self, name), 1, nullable=True)
        rep, shard, tp = self.degrees(world_size)
        if self.enabled and rep * shard * tp != world_size:
            fill = " (with dp_replicate and dp_shard null, dp_replicate takes world_size / tp)" if \
                self.dp_replicate is None and self.dp_shard is None else ""
            raise ConfigError("dist.parallel", f"dp_replicate={rep} x dp_shard={shard} x tp={tp} = {rep * shard * tp}"
                              f" ranks, but dist.world_size={world_size}: the product must equal the world size"
                              f"{fill}; set dist.world_size to a multiple of {shard * tp} or the degrees to fit")


@dataclass
class DistConfig:
    """``dist.*``: how many ranks and how they come to exist (``launcher: local`` = torch.distributed.elastic
    on this machine). master_port 0 = a free port chosen by the rendezvous. ranks_per_node: under a
    scheduling launcher, ranks per node (null = the launcher's gpus_per_node, or all ranks on one node).
    threads: intra-op threads of each rank (``torch.set_num_threads``); null = 1 in ``eval.mode=bitwise`` (a
    value that does not change with the world size, so outputs do not either) and the machine's cores shared
    among the local ranks in ``fast`` mode.
    allocator: the ranks' malloc (``disteval.common.allocator``): auto (tcmalloc, else jemalloc where installed,
    else glibc-tuned) | system | glibc-tuned | tcmalloc | jemalloc; put into the environment the ranks are
    started with (never into the driver's own), recorded in results.json ``allocator``.
    parallel: a device mesh for models split over several devices (``ParallelConfig``; all null = none)."""

    world_size: int = 2
    launcher: str = "local"
    device: Device = Device.auto
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    ranks_per_node: Optional[int] = None
    threads: Optional[int] = None
    allocator: str = "auto"
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # mixed hardware (docs/metrics.md, Mixed hardware): every rank forwards the dataset's first canary_samples samples
    # before the loop and the ranks compare a 16-byte digest of the outputs (0 = no canary; under eval.compile
    # the probe is one whole batch, the loop's shape); heterogeneous: warn | refuse | pin
    canary_samples: int = 32
    heterogeneous: Heterogeneous = Heterogeneous.warn
    # across nodes (docs/running-across-nodes.md): run the same command on each of ``nnodes`` nodes; world_size
    # is the total (world_size / nnodes ranks per node); rdzv_endpoint HOST:PORT is where the nodes meet (c10d
    # rendezvous, hosted by the node that owns HOST); node_rank null = order chosen by the rendezvous, a value =
    # torchrun's --node-rank (static rendezvous: node 0 owns the endpoint); local_addr: the address this node
    # advertises (null = the hostname's, which must not resolve to loopback)
    nnodes: int = 1
    node_rank: Optional[int] = None
    rdzv_endpoint: Optional[str] = None
    local_addr: Optional[str] = None
    # seconds without a heartbeat that make a rank silent (stopped, frozen, dead) to its peers' watchdogs; null =
    # communication.timeout_s (disteval/common/liveness.py: the three timeouts and what each one means)
    heartbeat_timeout_s: Optional[float] = None

    def validate(self) -> None:
        """Raises ConfigError naming the ``dist.*`` key."""
        _at_least("dist.world_size", self.world_size, 1)
        _finite_positive("dist.heartbeat_timeout_s", self.heartbeat_timeout_s, nullable=True, most=MAX_TIMEOUT_S)
        _at_least("dist.nnodes", self.nnodes, 1)
        if self.nnodes > 1:
            if self.world_size % self.nnodes:
                raise ConfigError("dist.world_size", f"{self.world_size} ranks cannot be spread evenly over "
                                  f"dist.nnodes={self.nnodes} nodes (world_size is the total over all nodes)")
            host, _, port = (self.rdzv_endpoint or "").rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) <= 65535:
                raise ConfigError("dist.rdzv_endpoint", f"dist.nnodes={self.nnodes} needs the rendezvous as HOST:PORT "
                                  f"(a port every node can reach on HOST), got {self.rdzv_endpoint!r}")
            if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
                raise ConfigError("dist.node_rank", f"must be in 0..{self.nnodes - 1} (or null), got {self.node_rank}")
        elif self.node_rank not in (None, 0):
            raise ConfigError("dist.node_rank", f"{self.node_rank} given with dist.nnodes=1")
        self.parallel.validate(self.world_size)
        if self.allocator not in ALLOCATORS:
            raise ConfigError("dist.allocator", f"{self.allocator!r} is not one of {list(ALLOCATORS)}")
        _at_least("dist.threads", self.threads, 1, nullable=True)
        _at_least("dist.canary_samples", self.canary_samples, 0)
        if not 0 <= self.master_port <= 65535:
            raise ConfigError("dist.master_port", f"must be a TCP port in 1..65535, or 0 to pick a free port, got "
                              f"{self.master_port}")
        if self.launcher != "local":
            raise ConfigError("dist.launcher", f"unknown launcher {self.launcher!r}; available: ['local'] "
                              "(or start ranks yourself with torchrun)")


@dataclass
class CIConfig:
    """``eval.ci.*``: bootstrap confidence intervals of top-k accuracy and NLL over the samples
    (``disteval.metrics.bootstrap``; classification): ``resamples`` (0 = none), ``level``, ``seed``; identical at
    every world size in bitwise mode."""

    resamples: int = 0
    level: float = 0.95
    seed: int = 0

    def validate(self) -> None:
        _at_least("eval.ci.resamples", self.resamples, 0)
        if 0 < self.resamples < CI_MIN_RESAMPLES or self.resamples > CI_MAX_RESAMPLES:
            raise ConfigError("eval.ci.resamples", f"0 (off) or {CI_MIN_RESAMPLES:,}..{CI_MAX_RESAMPLES:,}, got "
                              f"{self.resamples:,}: fewer resamples cannot place a percentile interval's ends (1,000 "
                              "is usual), more take minutes to hours on rank 0 after the evaluation")
        if not 0 < self.level < 1:
            raise ConfigError("eval.ci.level", f"must be in (0, 1), got {self.level}")


CI_MIN_RESAMPLES, CI_MAX_RESAMPLES = 50, 100_000


@dataclass
class JournalConfig:
    """``eval.journal.*``: durable progress (``disteval.rank.journal``). enabled: every rank records what it
    evaluated as it goes, so that ``eval.resume=RUN_DIR`` can finish an interrupted run at any world size;
    every_batches / every_s: a rank records after this many batches or seconds, whichever comes first (at most
    that much work of a rank is evaluated again after it dies; with ``eval.trials`` > 1 the first pass). Runs the
    journal cannot resume exactly (a sampler that pads or drops) record nothing; results.json ``journal`` says
    why. The intervals' per-sample rows (``eval.ci``) and the prediction store's
    rows (``eval.save_predictions``) are recorded with the metric states."""

    enabled: bool = True
    every_batches: int = 50
    every_s: float = 30.0

    def validate(self) -> None:
        _at_least("eval.journal.every_batches", self.every_batches, 1)
        _finite_positive("eval.journal.every_s", self.every_s, most=86400.0)


@dataclass
class PredictionsConfig:
    """``eval.predictions.*``: what ``eval.save_predictions=true`` stores per sample
    (RUN_DIR/predictions/rank{r}.parquet and _manifest.json; columns per task in
    ``disteval.data.prediction_columns``). Classification: the ``topk`` classes and their softmax probabilities;
    ``logits``: the full logits too (re-scoring, ``python -m disteval.rescore``, needs them). Detection: each
    image's boxes, scores and labels. Segmentation: each image's confusion counts; ``label_maps``: its predicted
    label map too. Embeddings: each sample's embedding."""

    topk: int = 5
    logits: bool = False
    label_maps: bool = False


# keys that moved into a task's own node (2026-12): an override of the old name is refused naming the new one
MOVED_KEYS = {"eval.topk": "eval.classification.topk", "eval.ece_bins": "eval.classification.ece_bins",
              "eval.iou_type": "eval.detection.iou_type", "eval.ignore_index": "eval.segmentation.ignore_index"}


CONFIG_GROUPS = {"model", "data", "precision", "communication", "dist", "console", "logger", "experiment", "hydra"}


def schema_keys(cls: type = None, prefix: str = "") -> tuple[set[str], set[str]]:
    """``(keys, open_nodes)`` of the job schema (``DistevalConfig``): every dotted key a command line may set, and
    the nodes whose children are free (``Dict``/``Any`` fields such as ``model.kwargs``)."""
    import dataclasses
    import typing

    cls = cls or DistevalConfig
    keys, open_nodes = set(), set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key, tp = f"{prefix}{f.name}", hints[f.name]
        keys.add(key)
        if dataclasses.is_dataclass(tp):
            sub, sub_open = schema_keys(tp, key + ".")
            keys |= sub
            open_nodes |= sub_open
        elif tp is Any or typing.get_origin(tp) in (dict, typing.Union) and (
                typing.get_origin(tp) is dict or Any in typing.get_args(tp)):
            open_nodes.add(key)
    return keys, open_nodes


def unknown_key(override: str) -> str | None:
    """A message for a command-line ``override`` (``key=value``, ``+key=value``) whose key the job schema does not
    have (a misspelling: Hydra's own error suggests ``+key=...``, which fails again), naming the closest valid
    keys; None for a known key, a key under a free node (``model.kwargs.*``), a config group choice, a deletion
    or a ``hydra.*`` key."""
    import difflib

    if override.startswith("~") or "=" not in override:
        return None
    key = override.lstrip("+").split("=", 1)[0]
    if "/" in key or key.split(".")[0] == "hydra" or "." not in key and key in CONFIG_GROUPS:
        return None
    keys, open_nodes = schema_keys()
    if key in keys or any(key.startswith(node + ".") for node in open_nodes):
        return None
    parent = key.rsplit(".", 1)[0]
    depth = key.count(".")  # keys as deep as the one given: a misspelt leaf suggests leaves, not their node
    close = difflib.get_close_matches(key, sorted(k for k in keys if k.count(".") == depth), n=3, cutoff=0.8)
    hint = f"did you mean {' or '.join(close)}?" if close else (
        f"the keys of {parent}: {', '.join(sorted(k.rsplit('.', 1)[1] for k in keys if '.' in k and k.rsplit('.', 1)[0] == parent))}"
        if parent in keys else "see docs/configuration.md")
    return f"{key}: no such key; {hint}"


def composition_problem(exc: BaseException) -> str | None:
    """One line for Hydra's error composing the config from YAML files (a ``ConfigCompositionException`` whose
    cause names ``full_key``): a key of ``MOVED_KEYS`` (an old option name inside a YAML file) named with its new
    place, an unknown key with the closest valid keys (``unknown_key``); each with the file Hydra names. None
    for any other error (Hydra's own message stands)."""
    import re

    cause = exc.__cause__ or exc.__context__  # Hydra raises it inside ``except`` without ``from``
    key = getattr(cause, "full_key", None)
    if not key:
        return None
    where = re.match(r"In '([^']+)'", str(exc))
    source = f" (in {where.group(1)}.yaml)" if where else ""
    if key in MOVED_KEYS:
        return f"{key}{source}: moved to {MOVED_KEYS[key]} (each task's options have a node of their own); write it there"
    problem = unknown_key(f"{key}=")
    return None if problem is None else problem.replace(f"{key}:", f"{key}{source}:", 1)


def moved_key(override: str) -> str | None:
    """A message for a command-line ``override`` that sets (or deletes, ``~``) a key of ``MOVED_KEYS``, naming
    its new place and the override to use instead, else None."""
    key, eq, value = override.lstrip("+~").partition("=")
    new = MOVED_KEYS.get(key)
    if new is None:
        return None
    instead = f"~{new}{eq}{value}" if override.startswith("~") else f"{new}={value}"
    return f"{key}: moved to {new} (each task's options have a node of their own); use {instead}"


@dataclass
class EvalBase:
    """``eval.*``: metric families (classification, ranking; coco for detection data) and how the run goes;
    each task's own options are in a node of their own, ``eval.<task>``, registered by the task's module in
    ``disteval.options`` (``EvalConfig`` is this class with one field per registered options class), each validated
    by its ``validate``. save_predictions: each rank writes its samples'
    predictions as Parquet
    (RUN_DIR/predictions/, see ``PredictionsConfig``); detection also as a COCO results file
    RUN_DIR/ranks/rank{r}/predictions.json. trials: evaluate the dataset this many times; when the
    trials disagree, each scalar metric is their ``trial_aggregate`` (mean | median | sigma_clip: the mean of
    trials within clip_sigma * 1.4826 * MAD of the median), see ``disteval.metrics.robust``. outlier_z: per-rank
    local top-1 accuracies with a modified z-score beyond it are reported as outlier ranks;
    exclude_outlier_ranks: leave those ranks' samples out of the final metrics (opt-in; results.json states how
    many samples were left out). status_interval_s: seconds between status.json
    updates (and progress refreshes) of a rank. mode: bitwise | fast (see ``Mode``). task: ``auto`` (by
    data.name), a registered task name (docs/configuration.md's task table) or ``package.module:ClassName``.
    record_batches: each rank writes ranks/rank{r}/batches.json (per-sample output digests and per-batch float
    partials) for ``python -m diagnostics compare``. overwrite: a run directory that holds a finished run's
    results.json is refused unless true; then the old records (results, ranks/, .hydra/, logs) are moved to
    RUN_DIR/previous/<time>-<pid>/ first (``disteval.job.rundir``). compile: ``torch.compile`` the model (opt-in;
    ``dynamic=False``, so every rank compiles the same static kernels for each batch shape, whatever its shard;
    the first batch, which compiles, is timed apart as results.json ``throughput.warmup_s`` and left out of
    the images/s). compile_mode: torch.compile's mode (default | reduce-overhead | max-autotune |
    max-autotune-no-cudagraphs). compile_backend: torch.compile's backend (inductor; ``eager`` or ``aot_eager``
    trace the model without generating kernels: for checking that a model compiles, and in the tests).
    With save_predictions=true a segmentation run writes its predicted maps as a COCO-style results file
    (image_id = sample id, category_id = class index). journal: durable progress (``JournalConfig``). resume: the
    run directory of an interrupted run whose recorded progress this run adds instead of evaluating it again,
    at any world size (``disteval.rank.journal``); refused before any rank starts when it was another run.
    ``auto`` (default): a run directory given again resumes its newest unfinished earlier run (moved to
    RUN_DIR/previous/) when the settings match; null: never."""

    mode: Mode = Mode.bitwise
    task: str = "auto"
    record_batches: bool = True
    metrics: List[str] = field(default_factory=lambda: ["classification"])
    trials: int = 1
    trial_aggregate: str = "median"
    clip_sigma: float = 3.0
    outlier_z: float = 3.5
    exclude_outlier_ranks: bool = False
    status_interval_s: float = 1.0
    progress: bool = True
    save_predictions: bool = False
    overwrite: bool = False
    compile: bool = False
    compile_mode: str = "default"
    compile_backend: str = "inductor"
    predictions: PredictionsConfig = field(default_factory=PredictionsConfig)
    ci: CIConfig = field(default_factory=CIConfig)
    journal: JournalConfig = field(default_factory=JournalConfig)
    resume: Optional[str] = "auto"

    def validate(self) -> None:
        """Raises ConfigError naming the ``eval.*`` key."""
        for name in (*sorted(OPTIONS), "ci", "journal"):
            getattr(self, name).validate()
        _at_least("eval.predictions.topk", self.predictions.topk, 1)
        _at_least("eval.trials", self.trials, 1)
        if self.trial_aggregate not in AGGREGATES:
            raise ConfigError("eval.trial_aggregate", f"{self.trial_aggregate!r} is not one of {list(AGGREGATES)}")
        _finite_positive("eval.clip_sigma", self.clip_sigma)
        _finite_positive("eval.outlier_z", self.outlier_z)
        _finite_positive("eval.status_interval_s", self.status_interval_s, most=3600.0)
        if not self.metrics:
            raise ConfigError("eval.metrics", "needs at least one metric family")
        if self.compile and self.compile_backend not in _compile_backends():
            raise ConfigError("eval.compile_backend", f"{self.compile_backend!r} is not a torch.compile backend; "
                              f"known: {_compile_backends()}")
        if self.compile_mode not in COMPILE_MODES:
            raise ConfigError("eval.compile_mode", f"{self.compile_mode!r} is not one of {list(COMPILE_MODES)}")


def _eval_config() -> type:
    """``EvalBase`` with a node per registered task options class (``disteval.options.OPTIONS``), as a dataclass
    that OmegaConf and pickle see as ``disteval.config.EvalConfig``."""
    clash = sorted(set(OPTIONS) & {f.name for f in fields(EvalBase)})
    if clash:
        raise ValueError(f"task options {clash} clash with eval.* keys of their own")
    cls = make_dataclass("EvalConfig", [(name, OPTIONS[name], field(default_factory=OPTIONS[name]))
                                        for name in sorted(OPTIONS)], bases=(EvalBase,))
    cls.__module__, cls.__doc__ = __name__, EvalBase.__doc__
    return cls


EvalConfig = _eval_config()


@dataclass
class DistevalConfig:
    """The whole job configuration (``python -m disteval --cfg job`` prints it)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    communication: CommunicationConfig = field(default_factory=CommunicationConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    seed: int = 0

    def validate(self) -> None:
        """Every group's own checks, then the ones across groups. Raises ConfigError naming the key."""
        for group in (self.data, self.precision, self.communication, self.dist, self.eval):
            group.validate()
        if self.eval.exclude_outlier_ranks and self.data.sampler != "exact":
            raise ConfigError("eval.exclude_outlier_ranks", f"needs data.sampler=exact: with {self.data.sampler} the "
                              "ranks share repeated samples, so leaving a rank out is not leaving its shard out")
        self._check_checkpoints()  # eval.exclude_outlier_ranks needs the task's Task.rank_metric (the preflight)


    def _check_checkpoints(self) -> None:
        """``model.checkpoints`` with what it cannot be combined with yet (each named)."""
        if not self.model.checkpoints:
            return
        clash = [(self.model.checkpoint, "model.checkpoint", "it names one file, model.checkpoints several"),
                 (self.eval.trials > 1, "eval.trials", "repeated trials of several checkpoints are not supported"),
                 (self.dist.parallel.enabled, "dist.parallel", "a device mesh shards one model"),
                 (self.eval.exclude_outlier_ranks, "eval.exclude_outlier_ranks",
                  "outlier ranks are found from one local accuracy per rank")]
        for on, key, why in clash:
            if on:
                raise ConfigError("model.checkpoints", f"cannot be combined with {key} ({why}); run one job per "
                                  "checkpoint for it")


@dataclass
class JobConfig(DistevalConfig):
    """What a rank receives: the validated ``DistevalConfig`` plus what the driver found while checking it
    (not settable on the command line: the Hydra schema is ``DistevalConfig``).

    experiment_name: the ``+experiment=`` choice (``default`` without one). communication_profile: the
    communication profile in force (``{"name", "device", "applied"}``, ``disteval.comm.profiles``) or None.
    preflight_notes: the preflight's warnings, also written into results.json ``warnings``."""

    experiment_name: str = "default"
    communication_profile: Optional[Dict[str, Any]] = None
    preflight_notes: List[str] = field(default_factory=list)


def _schema_part(cfg: Any, schema: type) -> dict:
    """The keys of ``schema`` in ``cfg`` (a DictConfig or dict) as plain values: a composed config may also
    hold an unresolvable hydra node."""
    container = {}
    for key in schema.__dataclass_fields__:
        if key in cfg:
            value = cfg[key]
            container[key] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    return container


def validated(cfg: Any) -> DistevalConfig:
    """The job config (a DictConfig or plain dict, extra driver keys ignored) as a validated
    ``DistevalConfig`` object. Raises ConfigError naming the key."""
    obj = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DistevalConfig), _schema_part(cfg, DistevalConfig)))
    obj.validate()
    return obj


def job_config(cfg: Any) -> JobConfig:
    """The job as its ranks receive it: ``cfg`` (the driver's job container, a plain dict or DictConfig with the
    driver keys of ``JobConfig``) as a validated, typed ``JobConfig`` (enums as ``StrEnum`` members, lists and
    dicts plain). Raises ConfigError naming the key."""
    if isinstance(cfg, JobConfig):
        return cfg
    obj = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(JobConfig), _schema_part(cfg, JobConfig)))
    obj.validate()
    return obj



def run_name() -> str:
    """Default run folder name: ``HH-MM-SS-ffffff`` of now, or, under an external torchrun (where every rank
    composes its own config), the launcher's shared ``TORCHELASTIC_RUN_ID`` so that all ranks agree."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id not in ("", "none") and "RANK" in os.environ:
        return f"torchrun-{run_id}"
    return datetime.now().strftime("%H-%M-%S-%f")


def register_schemas() -> None:
    """Store the schema in Hydra's ConfigStore under the name ``disteval_schema`` and register the
    ``disteval_run_name`` resolver used by ``hydra.run.dir`` (idempotent)."""
    ConfigStore.instance().store(name="disteval_schema", node=DistevalConfig)
    OmegaConf.register_new_resolver("disteval_run_name", run_name, replace=True, use_cache=True)


def conf_dir() -> str:
    """Hydra ``config_path`` for conf/: the checkout's ``conf/`` folder when running from a source tree
    (or an editable install), else ``pkg://disteval.conf`` inside an installed wheel.

    Raises FileNotFoundError when neither exists (a broken install).
    """
    checkout = Path(__file__).resolve().parent.parent / "conf"
    if (checkout / "config.yaml").is_file():
        return str(checkout)
    if importlib.util.find_spec("disteval.conf") is not None:
        return "pkg://disteval.conf"
    raise FileNotFoundError(f"disteval's conf/ was found neither at {checkout} nor as package disteval.conf")


def heterogeneous_policy(cfg: Any) -> str:
    """``dist.heterogeneous`` of a job config as a string (warn | refuse | pin; an enum or a plain value)."""
    value = cfg.dist.heterogeneous
    return str(getattr(value, "value", value))

