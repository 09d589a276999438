"""How dtp decodes a model: prefill a left-padded batch, then one token per step, with the model's
own KV cache where it has one.

A model whose forward takes `cache` or `past_key_values` (Hugging Face's, and models written to its
protocol) decodes with a `transformers.DynamicCache`: prefill runs the prompts with their attention mask and
positions counted from it (as `generate` does: `cumsum(mask) − 1`), each step runs one token per
row with the mask grown by one and the next position. The cache holds what the attention hands it:
under a plan that shards the attention by heads that is each rank's own heads, so the cache is
sharded as the attention is, with nothing added by dtp.

A model written as gpt-fast writes it (`setup_caches(max_batch_size, max_seq_length)` gives its
attention modules caches with `k_cache`/`v_cache` buffers (B, heads, max_seq, head_dim);
`forward(idx, input_pos)` writes them at `input_pos`) decodes through those: prefill runs
`forward(ids, input_pos=arange(T))`, each step `forward(token, input_pos=tensor([t]))`. With no
attention mask, prompts of different lengths cannot share a left-padded batch: each group of one
length is its own batch, its keys and values swapped into the cache modules around its forwards.
`setup_caches` sizes the caches by the head count it reads, which on a sharded model must be the
rank's (gpt-fast's tp.py rewrites the config first; a plan: `set config.n_local_heads =
n_local_heads / tp`); a cache with more heads than its attention computes stops the run.

A model with neither decodes by running the whole sequence again each step (no cache);
`cache_reason` says why.

The logits of a step are the last position's, read where `Forward` reads them (dtp.models.calling).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field, replace
from typing import Iterator

import torch
import torch.nn as nn

from dtp.models.calling import MASK, POSITIONS, Forward, takes_mask
from dtp.models.spec import max_sequence

# the cache argument: transformers ≥ 5.2 names it `cache`, earlier releases `past_key_values`
CACHES = ("cache", "past_key_values")
POSITION_IDS = "position_ids"
# gpt-fast's protocol: the method that makes the caches, the buffers of a cache module, and the
# attention attributes that hold the key/value heads it computes (gpt-fast's, torchchat's, …)
SETUP = "setup_caches"
SLOT_BUFFERS = ("k_cache", "v_cache")
KV_HEADS = ("n_local_heads", "n_kv_heads", "num_key_value_heads")


def _parameters(model: nn.Module) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def cache_name(model: nn.Module) -> str | None:
    """The forward's cache parameter, if it takes one."""
    names = _parameters(model)
    return next((n for n in CACHES if n in names), None)


def slot_positions(model: nn.Module) -> str | None:
    """The positions parameter of a gpt-fast-style model (a `setup_caches` method and a forward
    taking `input_pos`); None for any other model."""
    if not callable(getattr(model, SETUP, None)):
        return None
    names = _parameters(model)
    return next((n for n in POSITIONS if n in names), None)


def cache_reason(model: nn.Module) -> str | None:
    """None when `model` decodes with a KV cache; else why it does not (one clause)."""
    name = cache_name(model)
    if name is None and slot_positions(model):
        return None
    if name is None:
        return (
            "its forward takes no cache (`cache` or `past_key_values`) and it has no "
            f"`{SETUP}` with `input_pos` (gpt-fast's): each step runs the whole sequence again"
        )
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


@dataclass
class Group:
    """Rows of one prompt length, decoded as one batch through a gpt-fast model's caches."""

    rows: list[int]  # their indices in the batch
    tensors: list[dict[str, torch.Tensor]]  # per cache module: its buffers, this group's rows
    next_pos: int  # the position the next token takes


@dataclass
class Slots:
    """A gpt-fast model's caches for one decode: the cache modules `setup_caches` made, and each
    group's own keys and values, swapped into them around the group's forwards."""

    modules: list[nn.Module]
    groups: list[Group] = field(default_factory=list)

    def tensors(self) -> list[torch.Tensor]:
        """Every group's keys and values."""
        return [t for g in self.groups for held in g.tensors for t in held.values()]

    def add(self, rows: list[int]) -> Group:
        """A new group of `rows`, its keys and values zeroed, shaped as `setup_caches` made them."""
        zeros = [
            {
                b: getattr(m, b).new_zeros((len(rows), *getattr(m, b).shape[1:]))
                for b in SLOT_BUFFERS
            }
            for m in self.modules
        ]
        self.groups.append(Group(rows, zeros, 0))
        return self.groups[-1]


def _slot_modules(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module]]:
    """(path, cache module, its owner) for every module holding `SLOT_BUFFERS` tensors."""
    found = []
    for path, owner in model.named_modules():
        for name, child in owner.named_children():
            if all(isinstance(getattr(child, b, None), torch.Tensor) for b in SLOT_BUFFERS):
                found.append((f"{path}.{name}" if path else name, child, owner))
    return found


class CacheHeads(ValueError):
    """`setup_caches` made caches for more (or fewer) key/value heads than their attention computes:
    the head count it read was not rewritten for the rank."""


def _check_heads(path: str, cache: nn.Module, owner: nn.Module) -> None:
    """A cache must hold the key/value heads its attention computes (on a rank: its own)."""
    held = cache.k_cache.shape[1] if cache.k_cache.dim() == 4 else None
    attr = next((a for a in KV_HEADS if isinstance(getattr(owner, a, None), int)), None)
    if held is None or attr is None or getattr(owner, attr) == held:
        return
    raise CacheHeads(
        f"{SETUP} made {path}.k_cache for {held} key/value heads where its attention computes "
        f"{getattr(owner, attr)} (`{attr}`): {SETUP} read a head count the plan does not rewrite; "
        "rewrite it as gpt-fast's tp.py does before setup_caches (e.g. `set config.n_local_heads "
        "= n_local_heads / tp`)"
    )


@dataclass(frozen=True)
class Decoder:
    """Prefill and steps for one model, called as `forward` says."""

    forward: Forward
    cached: str | None  # the cache parameter it decodes through; None: the whole sequence each step
    masked: bool  # the forward takes the attention mask
    positioned: bool  # the forward takes position_ids
    # gpt-fast's protocol: the forward's positions parameter (`input_pos`); None: not that protocol
    slots: str | None = None
    # the most tokens a decode adds after the longest prompt: the length gpt-fast's caches are set
    # up for (None: the model's stated positions)
    new_tokens: int | None = None

    @classmethod
    def of(cls, model: nn.Module, forward: Forward, new_tokens: int | None = None) -> Decoder:
        """How `model` decodes (adding at most `new_tokens` tokens per prompt, where it matters)."""
        names = _parameters(model)
        name = cache_name(model)
        cached = name if name is not None and MASK in names else None
        slots = slot_positions(model) if name is None else None
        return cls(forward, cached, takes_mask(model), POSITION_IDS in names, slots, new_tokens)

    @property
    def with_cache(self) -> str | None:
        """What it decodes through, as the report names it: the forward's cache parameter,
        `setup_caches` (gpt-fast's caches) or None (the whole sequence each step)."""
        return self.cached or (SETUP if self.slots else None)

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
        if self.slots:
            return self._slot_prefill(model, ids, mask)
        state = State(ids, mask, new_cache(model) if self.cached else None)
        return self._run(model, state, ids, positions(mask)), state

    def step(self, model: nn.Module, state: State, token: torch.Tensor) -> torch.Tensor:
        """Append `token` (B,) to every row and return the next logits (B, V)."""
        state.ids = torch.cat([state.ids, token[:, None]], dim=1)
        state.mask = torch.cat([state.mask, torch.ones_like(state.mask[:, :1])], dim=1)
        if isinstance(state.cache, Slots):  # each group its token
            rows = [torch.tensor(g.rows, device=token.device) for g in state.cache.groups]
            outs = [
                self._slot_run(model, state.cache, g, token[r][:, None])
                for g, r in zip(state.cache.groups, rows)
            ]
            return _in_rows(state.cache, outs)
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

    # ---- gpt-fast's protocol ----
    def _slot_prefill(self, model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> tuple:
        """`setup_caches` once, then each group of equal-length prompts (pads stripped) as its own
        batch at positions 0 … L-1, with its own zeroed keys and values."""
        lengths = mask.long().sum(-1).tolist()
        rows: dict[int, list[int]] = {}
        for r, n in enumerate(lengths):
            rows.setdefault(n, []).append(r)
        longest = max(lengths)
        limit = max_sequence(model)
        size = longest + self.new_tokens if self.new_tokens is not None else limit or 2 * longest
        with torch.device(ids.device):
            getattr(model, SETUP)(max(map(len, rows.values())), size)
        found = _slot_modules(model)
        if not found:
            raise ValueError(
                f"{SETUP} made no module with {' and '.join(SLOT_BUFFERS)} buffers to decode through"
            )
        for path, cache, owner in found:
            _check_heads(path, cache, owner)
        slots = Slots([cache for _, cache, _ in found])
        outs = []
        for n, group_rows in rows.items():
            prompt = ids[torch.tensor(group_rows, device=ids.device), ids.shape[1] - n :]
            outs.append(self._slot_run(model, slots, slots.add(group_rows), prompt))
        return _in_rows(slots, outs), State(ids, mask, slots)

    def _slot_run(self, model: nn.Module, slots: Slots, group: Group, ids: torch.Tensor):
        """`group`'s next tokens (g, T) at the positions after its last: their last logits."""
        end, length = group.next_pos + ids.shape[1], slots.modules[0].k_cache.shape[2]
        if end > length:
            raise ValueError(
                f"the caches {SETUP} made hold {length} positions; decoding needs {end}"
            )
        pos = torch.arange(group.next_pos, end, device=ids.device)
        for m, held in zip(slots.modules, group.tensors):
            for b, t in held.items():
                setattr(m, b, t)
        output = replace(self.forward, positions=None).run(model, ids, **{self.slots: pos})
        for m, held in zip(slots.modules, group.tensors):  # a cache may replace, not write into
            for b in held:
                held[b] = getattr(m, b)
        group.next_pos = end
        return self.forward.logits(output)[:, -1]


@contextlib.contextmanager
def as_before(*roots: nn.Module) -> Iterator[None]:
    """Every module under `roots` as it was when the block began: what a decode's `setup_caches`
    added (cache modules, buffers, attributes such as the cache length its forward then reads) is
    removed, what it replaced put back. A proof that decodes must leave the model as it trains."""
    saved = [
        (
            m,
            dict(m._modules),
            dict(m._buffers),
            set(m._non_persistent_buffers_set),
            dict(m.__dict__),
        )
        for root in roots
        for m in root.modules()
    ]
    try:
        yield
    finally:
        for m, modules, buffers, transient, attrs in saved:
            m._modules.clear()
            m._modules.update(modules)
            m._buffers.clear()
            m._buffers.update(buffers)
            m._non_persistent_buffers_set.clear()
            m._non_persistent_buffers_set.update(transient)
            for name in set(m.__dict__) - set(attrs):
                del m.__dict__[name]
            m.__dict__.update(attrs)


def _in_rows(slots: Slots, outs: list[torch.Tensor]) -> torch.Tensor:
    """The groups' logits (g, V) back in the batch's row order (B, V)."""
    if len(outs) == 1:
        return outs[0]
    pieces = {r: out[i : i + 1] for g, out in zip(slots.groups, outs) for i, r in enumerate(g.rows)}
    return torch.cat([pieces[r] for r in sorted(pieces)])


def cache_tensors(cache: object) -> list[torch.Tensor]:
    """The tensors a cache holds (keys and values of every layer; a gpt-fast model's: every
    group's), for its bytes."""
    if isinstance(cache, Slots):
        return cache.tensors()
    out = []
    for layer in getattr(cache, "layers", []) or []:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                out.append(t)
    return out
