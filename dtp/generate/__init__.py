"""`dtp generate`: tensor-parallel greedy or seeded sampled decoding with the model's own KV cache,
sharded as its attention is, compared token by token with the unsharded model decoding beside it.

Modules: prompts (token ids from --prompt / --prompt-ids, left-padded), rank (what every rank does:
prefill, decode, choose each token greedily or by `Sampling`, compare on rank 0), command (pre-flight, launch, report).

Imports `verify`, `runtime` and everything below them.
"""

from dtp.generate.command import generate_command
from dtp.generate.rank import GenerateConfig, Sampling, generate

__all__ = ["GenerateConfig", "Sampling", "generate", "generate_command"]
