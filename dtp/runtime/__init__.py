"""Meshes, ranks and the one build path: local ranks on a loopback rendezvous (or torchrun's), pre-flight
estimates before anything is forked, the sharded model built and filled (scattered from a full copy or drawn by
the keyed generator), FSDP2 over dp, dropout RNG per region, and the collective counter.

Input: a `Checked` plan, a model source, a mesh. Output: an applied, filled model on every rank. Imports
`compiler`, `cost`, `checks`, `layout`, `lang`, `models`, `errors`.
"""
from dtp.runtime.build import build_sharded
from dtp.runtime.shard import Applied, apply

__all__ = ["build_sharded", "Applied", "apply"]
