"""The MODEL argument: a zoo name, a YAML config file, `package.module:factory`, or a Hugging Face
model directory."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.resources
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from dtp import files
from dtp.errors import UsageError, clip, shorten
from dtp.models import pretrained
from dtp.models.gpt import GPT, GPTConfig
from dtp.models.llama import Llama, LlamaConfig

# family name → (config class, model class); a YAML file picks one with `family:` (default gpt).
FAMILIES: dict[str, tuple[type, Callable[..., nn.Module]]] = {
    "gpt": (GPTConfig, GPT),
    "llama": (LlamaConfig, Llama),
}


def zoo_names() -> list[str]:
    """Names of the configs shipped in dtp/models/configs."""
    root = importlib.resources.files("dtp.models") / "configs"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


MAX_CONFIG_BYTES = 64 * 1024  # a model config is a handful of keys
MAX_MODULE_DEPTH = 200  # Python's recursion limit is 1000 frames; real models nest < 20
MAX_CONFIG_INT = 2**31  # larger sizes are typos (or attacks); nothing real comes near


def _load_yaml(name: str, text: str | None, path: Path | str) -> object:
    # one bounded loader for every user YAML (dtp/files.py): regular files, 64 KiB, no aliases,
    # depth ≤ 32
    if text is None:
        return files.load_yaml(path, "model config", MAX_CONFIG_BYTES, name)
    return files.parse_yaml(text, "model config", name)


def _numeric(value: object) -> bool:
    try:
        float(value)  # type: ignore[arg-type]
        return isinstance(value, str)
    except (TypeError, ValueError):
        return False


def _check_value(name: str, key: str, kind: str, value: object) -> None:
    """A config value of the field's declared type (`int`, `float` or `bool`), within sane bounds."""
    if kind == "bool" and not isinstance(value, bool):
        raise UsageError(f"model config {name}: {key} must be true or false, got {shorten(value)}")
    if kind == "int" and (not isinstance(value, int) or isinstance(value, bool)):
        hint = (
            " (YAML reads 1e12 as text and 1.0e12 as a float)"
            if isinstance(value, float) or _numeric(value)
            else ""
        )
        raise UsageError(
            f"model config {name}: {key} must be a positive integer, got {shorten(value)}{hint}"
        )
    if kind == "float" and (not isinstance(value, (int, float)) or isinstance(value, bool)):
        hint = (
            " (write numbers without quotes; YAML reads 1e-5 as text: write 1.0e-5)"
            if _numeric(value)
            else ""
        )
        raise UsageError(f"model config {name}: {key} must be a number, got {shorten(value)}{hint}")
    if kind in ("int", "float") and not (abs(value) <= MAX_CONFIG_INT and value == value):
        raise UsageError(
            f"model config {name}: {key} = {shorten(value)} is out of range (at most "
            f"{MAX_CONFIG_INT})"
        )


def read_config(path: Path | str, text: str | None = None) -> tuple[str, object]:
    """Parse a model YAML into (family, config); unknown keys and bad values are UsageErrors."""
    name = str(path)
    data = _load_yaml(name, text, path)
    return config_from_dict(name, data)


def config_from_dict(name: str, data: object) -> tuple[str, object]:
    """(family, config) from plain data (a YAML file's or a fuzz case's); every key and value is
    checked."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UsageError(f"model config {name} must be a mapping of keys to values")
    data = dict(data)
    family = data.pop("family", "gpt")
    if not isinstance(family, str) or family not in FAMILIES:
        raise UsageError(
            f"model config {name}: unknown family {shorten(family)}; known: "
            f"{', '.join(sorted(FAMILIES))}"
        )
    config_cls, _ = FAMILIES[family]
    fields = {
        f.name: getattr(f.type, "__name__", str(f.type)) for f in dataclasses.fields(config_cls)
    }
    for key, value in data.items():
        if key not in fields:
            raise UsageError(
                f"model config {name}: unknown key {shorten(key)}; known keys: {', '.join(fields)}"
            )
        _check_value(name, key, fields[key], value)
    try:
        return family, config_cls(**data)
    except (TypeError, ValueError) as err:
        raise UsageError(f"model config {name}: {clip(str(err), 300)}") from None


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from; cheap to pass to ranks (it is rebuilt there from the same seed)."""

    spec: str
    family: str | None = None
    config: object | None = None  # for zoo/YAML models
    factory: str | None = None  # "package.module:function"
    pretrained: str | None = None  # a save_pretrained directory (dtp.models.pretrained)

    @property
    def name(self) -> str:
        """The spec as the user wrote it."""
        return self.spec


def resolve(spec: str) -> ModelSource:
    """Interpret a MODEL argument without building anything."""
    if spec in zoo_names():
        text = (importlib.resources.files("dtp.models") / "configs" / f"{spec}.yaml").read_text(
            encoding="utf-8"
        )
        family, config = read_config(f"{spec}.yaml", text)
        return ModelSource(spec, family, config)
    if pretrained.is_pretrained_dir(spec):
        # refuse a bad or code-shipping config before anything is built
        pretrained.read_config(spec)
        return ModelSource(spec, pretrained=os.path.abspath(spec))  # ranks may start elsewhere
    if spec.endswith((".yaml", ".yml")):
        if not Path(spec).is_file():
            raise UsageError(f"model config {spec} does not exist")
        family, config = read_config(spec)
        return ModelSource(spec, family, config)
    if ":" in spec and not Path(spec).exists():
        module, _, func = spec.partition(":")
        if module and func and all(p.isidentifier() for p in module.split(".") + func.split(".")):
            return ModelSource(spec, factory=spec)
    raise UsageError(
        f"unknown model '{spec}': give a zoo name ({', '.join(zoo_names())}), "
        "a path to a model YAML file, package.module:factory, "
        "or a Hugging Face model directory (config.json + safetensors)"
    )


def _factory(path: str) -> Callable[[], nn.Module]:
    module_name, _, func_name = path.partition(":")
    # like torchrun and uvicorn: factories in the working directory import
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError as err:
        raise UsageError(
            f"cannot import '{module_name}' for model factory {path}: {clip(str(err), 300)}"
        ) from None
    except SyntaxError as err:
        raise UsageError(
            f"cannot import '{module_name}' for model factory {path}: SyntaxError in "
            f"{err.filename}:{err.lineno}: {clip(str(err.msg), 200)}"
        ) from None
    except Exception as err:  # noqa: BLE001 - the user's module raised while importing: one paragraph
        raise UsageError(
            f"importing '{module_name}' for model factory {path} raised {type(err).__name__}: "
            f"{clip(str(err), 300)}"
        ) from None
    for part in func_name.split("."):
        if not hasattr(obj, part):
            raise UsageError(
                f"model factory {path}: module '{module_name}' has no attribute '{func_name}'"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"model factory {path} is not callable")
    return obj  # type: ignore[return-value]


def build(
    source: ModelSource | str,
    device: str | torch.device = "meta",
    dtype: torch.dtype | None = None,
    weights: bool = True,
) -> nn.Module:
    """Instantiate the model on `device` (meta: shapes only, no memory); a pretrained directory's
    model holds its file's weights unless on meta or `weights` is False."""
    if isinstance(source, str):
        source = resolve(source)
    with torch.device(device):
        if source.pretrained is not None:
            model = pretrained.build_model(
                source.pretrained, weights and torch.device(device).type != "meta"
            )
        elif source.factory is None:
            _, model_cls = FAMILIES[source.family]
            try:
                model = model_cls(source.config)
            # n_embd: 2147483648 (the largest allowed)
            except (RuntimeError, OverflowError, MemoryError) as err:
                if isinstance(err, RuntimeError) and "overflow" not in str(err).lower():
                    raise
                raise UsageError(
                    f"model {source.name} is too large for any machine: one of its tensors would "
                    "hold "
                    f"more than 2^63 bytes (torch: {clip(' '.join(str(err).split()), 200)}); use "
                    "smaller "
                    "sizes"
                ) from None
        else:
            factory = _factory(source.factory)
            try:
                model = factory()
            except Exception as err:  # noqa: BLE001 - the user's code: one paragraph, not a traceback
                raise UsageError(
                    f"model factory {source.factory} raised {type(err).__name__}: "
                    f"{clip(str(err), 300)}"
                ) from None
            if not isinstance(model, nn.Module):
                raise UsageError(
                    f"model factory {source.factory} returned {type(model).__name__}, not an "
                    "nn.Module"
                )
            deepest = depth(model)
            if deepest > MAX_MODULE_DEPTH:
                raise UsageError(
                    f"model factory {source.factory} nests modules {deepest} deep; torch walks a "
                    f"model recursively (named_modules), and dtp takes at most {MAX_MODULE_DEPTH} "
                    "levels"
                )
    return cast(model, dtype)


def depth(model: nn.Module) -> int:
    """How deep `model`'s modules nest (the root alone: 1), found without recursion."""
    deepest, stack, seen = 0, [(model, 1)], set()
    while stack:
        module, level = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in module._modules.values() if child is not None)
    return deepest


def cast(model: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    """`model` with its floating tensors in `dtype` and its complex ones in the complex dtype of
    that precision (torchtitan's rotary `freqs_cis` is complex64): `nn.Module.to(dtype)` would cast
    a complex buffer to a real one, dropping its imaginary part, and the rotary embedding with it."""
    if dtype is None:
        return model
    complex_dtype = torch.complex128 if dtype == torch.float64 else torch.complex64

    def convert(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            return t.to(dtype)
        return t.to(complex_dtype) if t.is_complex() else t

    return model._apply(convert)


def vocab_size(model: nn.Module) -> int | None:
    """V: `model.config.vocab_size` where present, else the largest nn.Embedding's rows."""
    config = getattr(model, "config", None)
    if isinstance(getattr(config, "vocab_size", None), int):
        return config.vocab_size
    sizes = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    return max(sizes) if sizes else None


# Where configs state the longest sequence they were built for (nanoGPT, most HF families, GPT-2,
# GPT-J's n_ctx, MPT/Qwen, ChatGLM); a model without one (ALiBi, relative positions) accepts any
# length.
_MAX_SEQ_KEYS = (
    "block_size",
    "max_position_embeddings",
    "n_positions",
    "n_ctx",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
)


def max_sequence(model: nn.Module) -> int | None:
    """The longest sequence `model`'s config says it supports, or None when it states none."""
    config = getattr(model, "config", None)
    for key in _MAX_SEQ_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
