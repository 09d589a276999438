"""The model zoo and the MODEL argument (a zoo name, a YAML config, `package.module:factory` such as
`dtp.models.hf:gpt2`, or a Hugging Face directory written by save_pretrained).

Input: a spec. Output: an `nn.Module` (on the meta device unless asked), its vocabulary size.
Imports `dtp.errors` only. Modules: spec (the registry, YAML loader, factories), gpt, llama, hf
(Hugging Face builders), examples, pretrained (save_pretrained directories).
"""

from dtp.models.gpt import GPT, GPTConfig
from dtp.models.pretrained import check_weights
from dtp.models.spec import (
    FAMILIES,
    ModelSource,
    build,
    cast,
    config_from_dict,
    max_sequence,
    read_config,
    resolve,
    vocab_size,
    zoo_names,
)

__all__ = [
    "GPT",
    "GPTConfig",
    "check_weights",
    "FAMILIES",
    "ModelSource",
    "build",
    "cast",
    "config_from_dict",
    "max_sequence",
    "read_config",
    "resolve",
    "vocab_size",
    "zoo_names",
]
