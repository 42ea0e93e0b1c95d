"""disteval: exact, fast and diagnosable distributed evaluation of vision models.

Layers: ``disteval.data`` (exact shards), ``disteval.comm`` (few, coalesced, pickle-free collectives),
``disteval.metrics`` (mergeable sufficient statistics); ``disteval.rank.engine`` wires them per rank.
"""
__version__ = "0.1.0"
