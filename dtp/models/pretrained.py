"""A local Hugging Face model directory as a MODEL: `config.json` plus safetensors shard(s), as
`save_pretrained` writes them (one `model.safetensors`, or several listed by
`model.safetensors.index.json`).

Safe by default: config.json and the index go through dtp.files' bounded JSON loader, every file
read is a regular file named inside the directory, a model that asks for its own code (`auto_map`,
`trust_remote_code`) is refused and pickled weights (`pytorch_model.bin`) are never read. The
architecture comes from transformers' own classes (`AutoModelForCausalLM.from_config`); the weights
are read tensor by tensor, or slice by slice (`Weights.read`), so that a sharded run never holds the
whole model on one rank (dtp.runtime.pretrained).
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.nn as nn

from dtp import files
from dtp.errors import UsageError, clip, shorten

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# a config.json is a few KiB (with a tokenizer's vocabulary inlined, rarely more)
MAX_CONFIG_BYTES = 1024 * 1024
MAX_LAYERS = 4096  # the deepest published models have ~100; a million is a typo or an attack
REMOTE = ("auto_map", "trust_remote_code")  # code shipped in the directory, at any depth
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
MAX_SIZE = 2**31  # as the zoo's YAML configs: larger is a typo or an attack
# sizes a model is built from: 0, negative, a string or NaN would reach torch as a traceback
SIZE_KEYS = (
    "hidden_size",
    "n_embd",
    "num_attention_heads",
    "n_head",
    "num_key_value_heads",
    "intermediate_size",
    "n_inner",
    "vocab_size",
    "head_dim",
    "max_position_embeddings",
    "n_positions",
)
# a config's choice of kernels: dtp chooses (transformers' defaults), nothing is fetched
IMPLEMENTATIONS = (
    "attn_implementation",
    "_attn_implementation",
    "_attn_implementation_internal",
    "experts_implementation",
    "_experts_implementation",
)
MAX_INDEX_BYTES = 16 * 1024 * 1024  # one line per tensor: a 1000-layer MoE stays far below


def is_pretrained_dir(spec: str) -> bool:
    """Whether the MODEL argument names a directory holding a config.json."""
    return os.path.isdir(spec) and os.path.lexists(os.path.join(spec, CONFIG))


def read_config(directory: str) -> dict:
    """config.json as a dict, checked: a mapping, a model_type transformers knows, no code of its
    own."""
    config = _regular(directory, CONFIG, "Hugging Face config")  # never through a link
    data = files.load_json(config, "Hugging Face config", MAX_CONFIG_BYTES)
    if not isinstance(data, dict):
        raise UsageError(
            f"{directory}/{CONFIG} must hold a JSON object (a Hugging Face model config)"
        )
    for where, key, value in entries(data):
        if key in REMOTE and value:
            raise UsageError(
                f"{directory}/{CONFIG} sets {where}: the model's classes are code shipped in its "
                "directory, which dtp never runs; use a model type transformers implements itself, "
                "or wrap your own class in a factory (MODEL = package.module:factory)"
            )
        if key in LAYER_KEYS and not _count(value, MAX_LAYERS):
            raise UsageError(
                f"{directory}/{CONFIG}: {where} is {shorten(value)}; a model has 1 to "
                f"{MAX_LAYERS} layers"
            )
        if key in SIZE_KEYS and value is not None and not _count(value, MAX_SIZE):
            raise UsageError(
                f"{directory}/{CONFIG}: {where} is {shorten(value)}; a size is an integer from 1 "
                f"to {MAX_SIZE}"
            )
    model_type = data.get("model_type")
    from transformers import CONFIG_MAPPING

    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise UsageError(
            f"{directory}/{CONFIG}: model_type {shorten(model_type)} is not one transformers "
            "implements (a config.json written by save_pretrained names one)"
        )
    return data


def _count(value: object, limit: int) -> bool:
    """Whether `value` is an integer in [1, limit] (not a bool, a string or a float)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= limit


def entries(value: object, where: str = "") -> Iterator[tuple[str, str, object]]:
    """(dotted path, key, value) of every key of a JSON object, at any depth (lists included)."""
    if isinstance(value, dict):
        for key, item in value.items():
            path = f"{where}.{key}" if where else str(key)
            yield path, key, item
            yield from entries(item, path)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from entries(item, f"{where}[{i}]")


def chosen_here(data: object) -> object:
    """`data` without the keys that choose an implementation (attention, experts): dtp chooses,
    from transformers' own; a name there (flash_attention_2, a Hub kernel) would make transformers
    import or download code."""
    if isinstance(data, dict):
        return {k: chosen_here(v) for k, v in data.items() if k not in IMPLEMENTATIONS}
    if isinstance(data, list):
        return [chosen_here(v) for v in data]
    return data


def hf_config(directory: str, data: dict | None = None):
    """The transformers config object of `directory` (from the checked config.json, without its
    choice of implementations)."""
    from transformers import CONFIG_MAPPING

    data = chosen_here(read_config(directory) if data is None else data)
    try:
        return CONFIG_MAPPING[data["model_type"]].from_dict(dict(data))
    except (TypeError, ValueError, KeyError) as err:
        raise UsageError(
            f"{directory}/{CONFIG} is not a valid {data['model_type']} config: "
            f"{clip(str(err), 300)}"
        ) from None


def build_model(directory: str, weights: bool) -> nn.Module:
    """`AutoModelForCausalLM` of the directory's config on torch's current device, float32; with
    `weights`, every parameter then holds the file's tensor (read whole: the unsharded model, for
    references)."""
    from transformers import AutoModelForCausalLM

    config = hf_config(directory)
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except ValueError as err:  # a config class without a causal LM (BERT, T5…)
        raise UsageError(
            f"{directory}: transformers has no causal language model for model_type "
            f"{config.model_type} ({clip(str(err), 200)})"
        ) from None
    if weights:
        load_whole(model, directory)
    return model


def _regular(directory: str, name: str, what: str) -> Path:
    if (
        not isinstance(name, str)
        or not name
        or any(c in name for c in "/\\\0")
        or name in (".", "..")
    ):
        raise UsageError(
            f"{directory}/{INDEX} names {shorten(name)} as a {what}: only file names inside the "
            "model directory are read"
        )
    path = Path(directory, name)
    try:
        mode = os.lstat(path).st_mode
    except OSError as err:
        raise UsageError(f"{what} {path} cannot be read: {err.strerror}") from None
    if not stat.S_ISREG(mode):
        raise UsageError(
            f"{what} {path} is not a regular file (links, FIFOs and devices are not read)"
        )
    return path


def weight_map(directory: str) -> dict[str, Path]:
    """Tensor name → the safetensors file holding it (from the index, or the single file's header)."""
    from safetensors import safe_open

    if os.path.lexists(os.path.join(directory, INDEX)):
        index = files.load_json(
            _regular(directory, INDEX, "safetensors index"), "safetensors index", MAX_INDEX_BYTES
        )
        mapping = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(mapping, dict):
            raise UsageError(f"{directory}/{INDEX} has no weight_map object (tensor name → file)")
        paths = {f: _regular(directory, f, "safetensors shard") for f in set(mapping.values())}
        return {str(k): paths[f] for k, f in mapping.items()}
    if not os.path.lexists(os.path.join(directory, SINGLE)):
        pickled = [
            n
            for n in ("pytorch_model.bin", "pytorch_model.bin.index.json")
            if Path(directory, n).exists()
        ]
        raise UsageError(
            f"{directory} has no {SINGLE} (nor {INDEX})"
            + (
                f"; its {pickled[0]} is a pickle, which dtp never loads (it can run code): convert "
                "it with save_pretrained(..., safe_serialization=True)"
                if pickled
                else ""
            )
            + "; dtp reads the weights from safetensors only"
        )
    path = _regular(directory, SINGLE, "safetensors file")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: path for name in f.keys()}
    except Exception as err:  # noqa: BLE001 - a corrupt header: safetensors raises its own error types
        raise UsageError(
            f"{path} is not a readable safetensors file: {clip(str(err), 200)}"
        ) from None


class Weights:
    """The directory's tensors, opened lazily per file; reads whole tensors or rows of one
    dimension."""

    def __init__(self, directory: str):
        self.directory = directory
        self.where = weight_map(directory)
        self._stack = ExitStack()
        self._open: dict[Path, object] = {}

    def __enter__(self) -> Weights:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _file(self, path: Path):
        from safetensors import safe_open

        if path not in self._open:
            try:
                self._open[path] = self._stack.enter_context(safe_open(str(path), framework="pt"))
            except Exception as err:  # noqa: BLE001 - a corrupt shard: one paragraph
                raise UsageError(
                    f"{path} is not a readable safetensors file: {clip(str(err), 200)}"
                ) from None
        return self._open[path]

    def find(self, names: list[str], shape: tuple[int, ...]) -> str:
        """The first of a parameter's names (tied weights have several) the files hold, checked
        against the model's `shape`; a missing or mis-shaped tensor is a UsageError."""
        name = next((n for n in names if n in self.where), None)
        if name is None:
            raise UsageError(
                f"{self.directory} holds no tensor {' or '.join(names)} that the model built from "
                "its "
                f"config.json has (shape {list(shape)}); the safetensors files must hold every "
                "parameter under its module path, as save_pretrained writes them"
            )
        stored = tuple(self._file(self.where[name]).get_slice(name).get_shape())
        if stored != tuple(shape):
            raise UsageError(
                f"{self.directory}: tensor {name} has shape {list(stored)} in "
                f"{self.where[name].name}, but the model built from config.json expects "
                f"{list(shape)}; the config and the weights do not belong together"
            )
        return name

    def read(
        self, name: str, dim: int | None = None, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Tensor `name` whole, or only `rows` of dimension `dim` (read one contiguous run at a
        time)."""
        f = self._file(self.where[name])
        if dim is None or rows is None:
            return f.get_tensor(name)
        sl = f.get_slice(name)
        pieces = [sl[(slice(None),) * dim + (slice(a, b),)] for a, b in runs(rows.tolist())]
        return torch.cat(pieces, dim) if len(pieces) != 1 else pieces[0]


def runs(rows: list[int]) -> Iterator[tuple[int, int]]:
    """Maximal [start, stop) runs of consecutive row indices, in order."""
    start = prev = None
    for r in rows:
        if start is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            yield start, prev + 1
        start = prev = r
    if start is not None:
        yield start, prev + 1


def aliases(model: nn.Module) -> dict[str, list[str]]:
    """A parameter's first name (as `named_parameters()` gives it) → every name it has (tied
    weights: the embedding and lm_head), first name first."""
    # keyed by the object, as named_parameters' own memo is
    names: dict[nn.Parameter, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(p, []).append(name)
    return {group[0]: group for group in names.values()}


@torch.no_grad()
def load_whole(model: nn.Module, directory: str) -> None:
    """Copy every parameter of `model` (unsharded) from the directory's files, converted to its
    dtype."""
    names = aliases(model)
    with Weights(directory) as w:
        for name, p in model.named_parameters():
            p.copy_(w.read(w.find(names[name], tuple(p.shape))))


def check_weights(model: nn.Module, directory: str) -> None:
    """Every parameter of `model` (on meta is enough) is in the directory's files with its shape:
    read from the safetensors headers only, so a bad directory is exit 2 before any rank starts."""
    names = aliases(model)
    with Weights(directory) as w:
        for name, p in model.named_parameters():
            w.find(names[name], tuple(p.shape))
        _no_foreign_modules(model, directory, w.where)


def _no_foreign_modules(model: nn.Module, directory: str, stored: dict[str, Path]) -> None:
    """Refuse tensors of modules the model does not have (a config.json with fewer layers than its
    weights would train a truncated model without a word); a stored buffer of a module it has (a
    rotary `inv_freq`, GPT-2's `attn.bias`) is harmless, and a class's own ignore patterns hold."""
    modules = {path for path, _ in model.named_modules()}
    ignored = [
        re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []
    ]
    foreign = sorted(
        n
        for n in stored
        if n.rpartition(".")[0] not in modules and not any(p.search(n) for p in ignored)
    )
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise UsageError(
            f"{directory} holds tensors of modules the model built from its config.json does not "
            f"have ({foreign[0]}{more}); the config and the weights do not belong together (fewer "
            "layers in the config than in the weights?)"
        )
