"""The MODEL argument: a zoo name, a YAML config file, or `package.module:factory`."""
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
import yaml

from dtp.errors import UsageError
from dtp.models.gpt import GPT, GPTConfig

# family name → (config class, model class); a YAML file picks one with `family:` (default gpt).
FAMILIES: dict[str, tuple[type, Callable[..., nn.Module]]] = {"gpt": (GPTConfig, GPT)}


def register_family(name: str, config_cls: type, model_cls: Callable[..., nn.Module]) -> None:
    """Make `family: NAME` available to YAML configs."""
    FAMILIES[name] = (config_cls, model_cls)


def zoo_names() -> list[str]:
    """Names of the configs shipped in dtp/models/configs."""
    root = importlib.resources.files("dtp.models") / "configs"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def read_config(path: Path | str, text: str | None = None) -> tuple[str, object]:
    """Parse a model YAML into (family, config); unknown keys and bad values are UsageErrors."""
    name = str(path)
    try:
        data = yaml.safe_load(text if text is not None else Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"cannot read model config {name}: {err}") from None
    except yaml.YAMLError as err:
        raise UsageError(f"model config {name} is not valid YAML: {err}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UsageError(f"model config {name} must be a mapping of keys to values")
    data = dict(data)
    family = data.pop("family", "gpt")
    if family not in FAMILIES:
        raise UsageError(f"model config {name}: unknown family '{family}'; known: {', '.join(sorted(FAMILIES))}")
    config_cls, _ = FAMILIES[family]
    known = [f.name for f in dataclasses.fields(config_cls)]
    for key in data:
        if key not in known:
            raise UsageError(f"model config {name}: unknown key '{key}'; known keys: {', '.join(known)}")
    try:
        return family, config_cls(**data)
    except (TypeError, ValueError) as err:
        raise UsageError(f"model config {name}: {err}") from None


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from; cheap to pass to ranks (it is rebuilt there from the same seed)."""

    spec: str
    family: str | None = None
    config: object | None = None  # for zoo/YAML models
    factory: str | None = None  # "package.module:function"

    @property
    def name(self) -> str:
        """The spec as the user wrote it."""
        return self.spec


def resolve(spec: str) -> ModelSource:
    """Interpret a MODEL argument without building anything."""
    if spec in zoo_names():
        text = (importlib.resources.files("dtp.models") / "configs" / f"{spec}.yaml").read_text(encoding="utf-8")
        family, config = read_config(f"{spec}.yaml", text)
        return ModelSource(spec, family, config)
    if spec.endswith((".yaml", ".yml")):
        if not Path(spec).is_file():
            raise UsageError(f"model config {spec} does not exist")
        family, config = read_config(spec)
        return ModelSource(spec, family, config)
    if ":" in spec and not Path(spec).exists():
        module, _, func = spec.partition(":")
        if module and func and all(p.isidentifier() for p in module.split(".") + func.split(".")):
            return ModelSource(spec, factory=spec)
    raise UsageError(f"unknown model '{spec}': give a zoo name ({', '.join(zoo_names())}), "
                     "a path to a model YAML file, or package.module:factory")


def _factory(path: str) -> Callable[[], nn.Module]:
    module_name, _, func_name = path.partition(":")
    if os.getcwd() not in sys.path:  # like torchrun and uvicorn: factories in the working directory import
        sys.path.insert(0, os.getcwd())
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError as err:
        raise UsageError(f"cannot import '{module_name}' for model factory {path}: {err}") from None
    for part in func_name.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"model factory {path}: module '{module_name}' has no attribute '{func_name}'")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"model factory {path} is not callable")
    return obj  # type: ignore[return-value]


def build(source: ModelSource | str, device: str | torch.device = "meta",
          dtype: torch.dtype | None = None) -> nn.Module:
    """Instantiate the model on `device` (meta: shapes only, no memory)."""
    if isinstance(source, str):
        source = resolve(source)
    with torch.device(device):
        if source.factory is None:
            _, model_cls = FAMILIES[source.family]
            model = model_cls(source.config)
        else:
            factory = _factory(source.factory)
            try:
                model = factory()
            except Exception as err:  # the user's code: one paragraph, not a traceback
                raise UsageError(f"model factory {source.factory} raised {type(err).__name__}: {err}") from None
            if not isinstance(model, nn.Module):
                raise UsageError(f"model factory {source.factory} returned {type(model).__name__}, not an nn.Module")
    if dtype is not None:
        model = model.to(dtype)
    return model


def vocab_size(model: nn.Module) -> int | None:
    """V: `model.config.vocab_size` where present, else the largest nn.Embedding's rows."""
    config = getattr(model, "config", None)
    if isinstance(getattr(config, "vocab_size", None), int):
        return config.vocab_size
    sizes = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    return max(sizes) if sizes else None


_HEAD_KEYS = ("n_head", "num_attention_heads", "n_heads", "num_heads")
_KV_KEYS = ("num_key_value_heads", "n_kv_head", "n_kv_heads", "num_kv_heads")
_HIDDEN_KEYS = ("n_embd", "hidden_size", "dim", "d_model")


@dataclass(frozen=True)
class Heads:
    """What the model's config says about attention heads (for divisibility checks)."""

    n_head: int
    n_kv_head: int
    head_dim: int
    source: str  # e.g. "config.n_head"
    kv_source: str = ""  # e.g. "config.num_key_value_heads"


def heads(model: nn.Module) -> Heads | None:
    """Head counts from the model's config object (`config`, `model_args` or `args`), if it has one."""
    for attr in ("config", "model_args", "args"):
        config = getattr(model, attr, None)
        if config is None:
            continue
        n_head = next(((k, getattr(config, k)) for k in _HEAD_KEYS if isinstance(getattr(config, k, None), int)), None)
        if n_head is None:
            continue
        kv = next(((k, getattr(config, k)) for k in _KV_KEYS if isinstance(getattr(config, k, None), int)), None)
        head_dim = getattr(config, "head_dim", None)
        if not isinstance(head_dim, int):
            hidden = next((getattr(config, k) for k in _HIDDEN_KEYS if isinstance(getattr(config, k, None), int)), None)
            if hidden is None:
                continue
            head_dim = hidden // n_head[1]
        source = f"{attr}.{n_head[0]}"
        return Heads(n_head[1], kv[1] if kv else n_head[1], head_dim, source, f"{attr}.{kv[0]}" if kv else source)
    return None


from dtp.models.llama import Llama, LlamaConfig  # noqa: E402  (after register_family exists)

register_family("llama", LlamaConfig, Llama)
