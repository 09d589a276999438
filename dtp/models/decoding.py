"""How dtp decodes a model: prefill a left-padded batch, then one token per step, with the model's
own KV cache where it has one.

A model whose forward takes `cache` or `past_key_values` (Hugging Face's, and models written to its
protocol) decodes with a `transformers.DynamicCache`: prefill runs the prompts with their attention mask and
positions counted from it (as `generate` does: `cumsum(mask) − 1`), each step runs one token per
row with the mask grown by one and the next position. The cache holds what the attention hands it:
under a plan that shards the attention by heads that is each rank's own heads, so the cache is
sharded as the attention is, with nothing added by dtp. A model without that parameter decodes by
running the whole sequence again each step (no cache); `cache_reason` says why.

The logits of a step are the last position's, read where `Forward` reads them (dtp.models.calling).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn as nn

from dtp.models.calling import MASK, Forward, takes_mask

# the cache argument: transformers ≥ 5.2 names it `cache`, earlier releases `past_key_values`
CACHES = ("cache", "past_key_values")
POSITION_IDS = "position_ids"


def _parameters(model: nn.Module) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def cache_name(model: nn.Module) -> str | None:
    """The forward's cache parameter, if it takes one."""
    names = _parameters(model)
    return next((n for n in CACHES if n in names), None)


def cache_reason(model: nn.Module) -> str | None:
    """None when `model` decodes with a KV cache; else why it does not (one clause)."""
    name = cache_name(model)
    if name is None:
        return "its forward takes no cache (`cache` or `past_key_values`): each step runs the whole sequence again"
    if MASK not in _parameters(model):
        return f"its forward takes `{name}` but no `{MASK}`"
    return None


def new_cache(model: nn.Module):
    """An empty cache for `model` (transformers' DynamicCache, told the model's config)."""
    from transformers import DynamicCache

    config = getattr(model, "config", None)
    if not hasattr(config, "get_text_config"):  # not a transformers config: a plain cache
        return DynamicCache()
    try:
        return DynamicCache(config=config)
    except TypeError:  # an older transformers: no config argument
        return DynamicCache()


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Each token's position counted from its row's first real token (pads at 0), as `generate`
    gives them."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


@dataclass
class State:
    """A batch being decoded: its tokens so far, mask, and the cache (None: recomputed)."""

    ids: torch.Tensor  # (B, T) every token so far, pads first
    mask: torch.Tensor  # (B, T) 1 for a token, 0 for a pad
    cache: object | None = None


@dataclass(frozen=True)
class Decoder:
    """Prefill and steps for one model, called as `forward` says."""

    forward: Forward
    cached: str | None  # the cache parameter it decodes through; None: the whole sequence each step
    masked: bool  # the forward takes the attention mask
    positioned: bool  # the forward takes position_ids

    @classmethod
    def of(cls, model: nn.Module, forward: Forward) -> Decoder:
        """How `model` decodes."""
        names = _parameters(model)
        cached = cache_name(model) if cache_reason(model) is None else None
        return cls(forward, cached, takes_mask(model), POSITION_IDS in names)

    def _kwargs(self, mask: torch.Tensor, pos: torch.Tensor, cache: object | None) -> dict:
        kwargs: dict = {}
        if self.masked:
            kwargs[MASK] = mask
        if self.positioned:
            kwargs[POSITION_IDS] = pos
        if self.cached:
            kwargs.update({self.cached: cache, "use_cache": True})
        return kwargs

    def prefill(self, model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> tuple:
        """(the last position's logits (B, V), the state) after the prompts."""
        state = State(ids, mask, new_cache(model) if self.cached else None)
        return self._run(model, state, ids, positions(mask)), state

    def step(self, model: nn.Module, state: State, token: torch.Tensor) -> torch.Tensor:
        """Append `token` (B,) to every row and return the next logits (B, V)."""
        state.ids = torch.cat([state.ids, token[:, None]], dim=1)
        state.mask = torch.cat([state.mask, torch.ones_like(state.mask[:, :1])], dim=1)
        pos = positions(state.mask)
        if self.cached:
            return self._run(model, state, token[:, None], pos[:, -1:])
        return self._run(model, state, state.ids, pos)

    def _run(self, model: nn.Module, state: State, ids: torch.Tensor, pos: torch.Tensor):
        kwargs = self._kwargs(state.mask, pos, state.cache)
        output = self.forward.run(model, ids, **kwargs)
        if self.cached:
            found = [getattr(output, n, None) for n in CACHES]
            state.cache = next((c for c in found if c is not None), state.cache)
        return self.forward.logits(output)[:, -1]


def cache_tensors(cache: object) -> list[torch.Tensor]:
    """The tensors a cache holds (keys and values of every layer), for its bytes."""
    out = []
    for layer in getattr(cache, "layers", []) or []:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                out.append(t)
    return out
