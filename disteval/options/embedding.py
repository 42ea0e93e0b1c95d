"""``eval.embedding.*``: the embedding task's options (``disteval/tasks/embedding.py``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from disteval.common.checks import at_least, finite_positive
from disteval.errors import ConfigError
from disteval.options import task_options

EMBEDDING_PROTOCOLS = ("knn", "retrieval", "zero_shot")


@task_options("embedding")
@dataclass
class EmbeddingConfig:
    """``eval.embedding.*`` (``eval.task=embedding``, ``disteval/tasks/embedding.py``).

    protocol: ``knn`` (gallery = data.split ``gallery_split``, queries = ``query_split``; kNN classification,
    optional mAP@R), ``retrieval`` (generated image-text pairs: recall@k image->text and text->image) or
    ``zero_shot`` (images classified against class-name text embeddings from ``templates``).
    layer: the module whose output is the embedding (e.g. ``classifier.3``, the shipped Fashion-MNIST CNN's
    penultimate layer); null = the model's ``encode_image`` / ``encode_text``. normalize: L2-normalise
    embeddings. similarity: ``ip`` (cosine when normalised) or ``l2``. knn_k, votes (weighted: DINO's
    exp(s/T) votes with ``temperature``; majority), recall_k, map_at_r: what is reported. chunk_size: queries
    per search round; tile_queries/tile_gallery: the fixed similarity tile (``disteval.common.topk``).
    precision: ``float32``, or ``bfloat16``/``float16`` for a low-precision pass that picks the gallery tiles
    that can hold a top-k item (margin from the rounding bound), re-scored in float32: the same exact top-k.
    gallery_limit / query_limit: first N items of each split (null = all). generated_images,
    captions_per_image, image_size: the generated pairs (``disteval.data.pairs``).
    """

    protocol: str = "knn"
    gallery_split: str = "train"
    query_split: str = "test"
    gallery_limit: Optional[int] = None
    query_limit: Optional[int] = None
    layer: Optional[str] = None
    normalize: bool = True
    similarity: str = "ip"
    knn_k: List[int] = field(default_factory=lambda: [10, 20, 100, 200])
    votes: List[str] = field(default_factory=lambda: ["weighted", "majority"])
    temperature: float = 0.07
    recall_k: List[int] = field(default_factory=lambda: [1, 5, 10])
    map_at_r: bool = False
    chunk_size: int = 1000
    tile_queries: int = 128
    tile_gallery: int = 1024
    precision: str = "float32"
    templates: List[str] = field(default_factory=lambda: ["a photo of a {}.", "a {} object."])
    generated_images: int = 512
    captions_per_image: int = 3
    image_size: int = 32

    def validate(self) -> None:
        """Raises ConfigError naming the ``eval.embedding.*`` key."""
        if self.protocol not in EMBEDDING_PROTOCOLS:
            raise ConfigError("eval.embedding.protocol", f"{self.protocol!r} is not one of {list(EMBEDDING_PROTOCOLS)}")
        if self.similarity not in ("ip", "l2"):
            raise ConfigError("eval.embedding.similarity", f"must be ip or l2, got {self.similarity!r}")
        if self.precision not in ("float32", "bfloat16", "float16"):
            raise ConfigError("eval.embedding.precision", f"must be float32, bfloat16 or float16, got {self.precision!r}")
        if self.precision != "float32" and self.similarity != "ip":
            raise ConfigError("eval.embedding.precision", "the low-precision candidate pass needs similarity=ip")
        bad = [v for v in self.votes if v not in ("weighted", "majority")]
        if bad or not self.votes:
            raise ConfigError("eval.embedding.votes", f"needs some of ['weighted', 'majority'], got {list(self.votes)}")
        for key, ks in (("knn_k", self.knn_k), ("recall_k", self.recall_k)):
            if any(k < 1 for k in ks) or (key == "knn_k" and not ks):
                raise ConfigError(f"eval.embedding.{key}", f"needs positive integers, got {list(ks)}")
        finite_positive("eval.embedding.temperature", self.temperature)
        for key in ("chunk_size", "tile_queries", "tile_gallery", "generated_images", "image_size"):
            at_least(f"eval.embedding.{key}", getattr(self, key), 1)
        for key in ("gallery_limit", "query_limit"):
            at_least(f"eval.embedding.{key}", getattr(self, key), 1, nullable=True)
        if not 1 <= self.captions_per_image <= 5:
            raise ConfigError("eval.embedding.captions_per_image", f"must be in 1..5, got {self.captions_per_image}")
        if not self.templates or any("{}" not in t for t in self.templates):
            raise ConfigError("eval.embedding.templates", f"each template needs a '{{}}' for the class name, got "
                              f"{list(self.templates)}")
