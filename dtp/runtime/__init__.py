"""Meshes, ranks and the one build path: local ranks on a loopback rendezvous (or torchrun's),
pre-flight estimates before anything is forked, the sharded model built and filled (scattered from a
full copy or drawn by the keyed generator), FSDP2 over dp, dropout RNG per region, and the
collective counter.

Input: a `Checked` plan, a model source, a mesh. Output: an applied, filled model on every rank.
Imports `compiler`, `cost`, `checks`, `layout`, `lang`, `models`, `errors`. The face names only the
launcher's entry points, so that `dtp fmt` (which asks `under_torchrun` on its way out) imports no
torch; `build.build_sharded` and `shard.apply` are imported from their modules.
"""

from dtp.runtime.launcher import launch_local
from dtp.runtime.ranks import on_ranks
from dtp.runtime.torchrun import under_torchrun

__all__ = ["launch_local", "on_ranks", "under_torchrun"]
