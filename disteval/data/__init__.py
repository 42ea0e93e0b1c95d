"""DATA LAYER: datasets that yield (input, target, sample_id), exact shards, eval transforms."""
from disteval.data.datasets import IndexedDataset, build_dataset, dataset_num_classes
from disteval.data.sharding import ExactShardSampler, shard_bounds

__all__ = ["IndexedDataset", "build_dataset", "dataset_num_classes", "ExactShardSampler", "shard_bounds"]
