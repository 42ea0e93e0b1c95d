"""COMMUNICATION LAYER: process group, coalesced all_reduce, variable-size gather, broadcast, timeouts.
Knows nothing of what the metrics mean."""
from disteval.comm.collectives import Communicator
from disteval.comm.process_group import (RankEnv, destroy_process_group, external_launch_detected,
                                         init_process_group, resolve_backend, resolve_device)

__all__ = ["Communicator", "RankEnv", "destroy_process_group", "external_launch_detected",
           "init_process_group", "resolve_backend", "resolve_device"]
