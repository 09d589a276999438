"""How dtp calls a model and where the logits are in what it returns, read off the model itself.

Models written the way the field writes them do not all take token ids and return logits:

| model | forward | returns |
|---|---|---|
| Hugging Face | `forward(input_ids, …, labels=None)` | a `ModelOutput` with `.logits` |
| nanoGPT | `forward(idx, targets=None)` | `(logits, loss)`; without targets the logits of the last position only |
| minGPT | `forward(idx, targets=None)` | `(logits, loss)` |
| gpt-fast | `forward(idx, input_pos)` | logits; `input_pos` (the tokens' positions) is required in practice |
| torchtitan | `forward(tokens, …)` | logits |

`discover` calls the model once on a meta twin (no memory, no data; its Python state is a copy) and
finds the logits by what they are: a floating tensor whose last dimension is the vocabulary, over
every position of the input (a `logits` key or attribute first; then tuples, lists, dicts,
dataclasses, depth-first). A model that gives every position's logits only when it is handed targets
(nanoGPT) is called with them; the loss it computes itself is not used (dtp computes the one it
compares). A parameter named `input_pos` (gpt-fast's and torchchat's positions of the tokens given,
shape (T,)) gets 0 … T-1. Where no rule decides, the run stops before launch with one line saying
what the model returns.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn

from dtp.errors import UsageError, clip
from dtp.models.clone import meta_twin

# gpt-fast, torchchat: a forward that indexes its caches and masks by these, (T,)
POSITIONS = ("input_pos",)
# nanoGPT, minGPT: forward(idx, targets=None); HF: labels
TARGETS = ("targets", "labels", "target", "label")
# Hugging Face: 1 for a token, 0 for padding, (B, T)
MASK = "attention_mask"
_MAX_DEPTH = 4  # nesting searched for the logits (a tuple in a dict in a dataclass …)
Path = tuple  # keys, attribute names and indices from the output to the logits


@dataclass(frozen=True)
class Forward:
    """How to call a model (extra inputs by name) and where its logits are; plain data, so it
    pickles to ranks."""

    positions: str | None = None  # a parameter given torch.arange(T)
    # a parameter given the targets: the model returns every position's logits only then
    targets: str | None = None
    # from the output to the logits: () the output itself, (0,) a tuple's first, ("logits",) …
    path: Path = ()
    # False: the model could not be run on meta; the output's `.logits` or the output itself
    read: bool = True
    # the module whose output is the logits: the forward ends there (its own loss unrun)
    stop: str | None = None

    def run(
        self,
        model: nn.Module,
        ids: torch.Tensor,
        targets: torch.Tensor | None = None,
        **extra: torch.Tensor,
    ) -> object:
        """`model`'s output for token ids (B, T) (and the targets, where the model needs them for
        full logits; `extra` by name, an attention mask); with `stop`, the output of that module,
        the rest of the forward not run."""
        kwargs: dict[str, torch.Tensor] = dict(extra)
        if self.positions:
            kwargs[self.positions] = torch.arange(ids.shape[-1], device=ids.device)
        if self.targets:
            # a forward without targets (an eval probe): ids stand in, the logits are the same
            if targets is None:
                targets = ids
            # An ignored label (-100) stands for nothing the logits depend on; a model's own loss
            # may not ignore it (nanoGPT ignores -1), and dtp does not read that loss.
            kwargs[self.targets] = torch.where(targets < 0, ids, targets)
        if self.stop is None:
            return model(ids, **kwargs)
        # The model's own loss after its head would run on the sharded logits (nanoGPT views them
        # whole) and add collectives dtp's comparison does not use: the forward ends at the head
        # instead.
        handle = model.get_submodule(self.stop).register_forward_hook(_stop_here)
        try:
            model(ids, **kwargs)
        except _Stopped as stopped:
            return stopped.output
        finally:
            handle.remove()
        raise RuntimeError(
            f"the model's forward did not run {self.stop}, whose output is its logits"
        )

    def logits(self, output: object) -> torch.Tensor:
        """The logits in `output`."""
        if self.stop is not None:
            return output  # type: ignore[return-value]
        if not self.read:
            return output.logits if hasattr(output, "logits") else output  # type: ignore[return-value]
        found = follow(output, self.path)
        if not isinstance(found, torch.Tensor):
            raise TypeError(
                f"the model's output at {show(self.path)} is {type(found).__name__}, not the logits"
            )
        return found

    def __call__(
        self,
        model: nn.Module,
        ids: torch.Tensor,
        targets: torch.Tensor | None = None,
        **extra: torch.Tensor,
    ) -> torch.Tensor:
        """The logits of `model` on `ids`."""
        return self.logits(self.run(model, ids, targets, **extra))


class _Stopped(Exception):
    """Control flow, not an error: carries the head's output out of the forward."""

    def __init__(self, output: object):
        super().__init__("stopped at the logits")
        self.output = output


def _stop_here(module: nn.Module, args: object, output: object) -> None:
    raise _Stopped(output)


def producer(
    model: nn.Module, run: Callable[[], object], found: Callable[[object], torch.Tensor]
) -> str | None:
    """The path of the last module whose output is the very tensor `found` picks from `run()`'s
    output."""
    made: dict[int, str] = {}
    hook = lambda name: lambda m, a, out: made.__setitem__(id(out), name)
    handles = [m.register_forward_hook(hook(name)) for name, m in model.named_modules() if name]
    try:
        output = run()
    finally:
        for h in handles:
            h.remove()
    return made.get(id(found(output)))


def takes_mask(model: nn.Module) -> bool:
    """Whether `model`'s forward takes an attention mask by name (`MASK`)."""
    try:
        return MASK in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a builtin or a C forward: no signature to read
        return False


def pad_id(model: nn.Module) -> int:
    """The id a batch is padded with: the config's `pad_token_id`, else 0."""
    value = getattr(getattr(model, "config", None), "pad_token_id", None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


PLAIN = Forward(read=False)  # model(ids) is the logits or carries `.logits` (Hugging Face, the zoo)


def follow(output: object, path: Path) -> object:
    """The value at `path` in `output`."""
    for step in path:
        if isinstance(step, int):
            output = output[step]  # type: ignore[index]
        elif isinstance(output, Mapping):
            output = output[step]
        else:
            output = getattr(output, step)
    return output


def show(path: Path) -> str:
    """`path` as Python would index the output: `output[0]`, `output.logits`."""
    text = "output"
    for step in path:
        text += (
            f"[{step}]"
            if isinstance(step, int)
            else f"[{step!r}]"
            if isinstance(step, str) and not step.isidentifier()
            else f".{step}"
        )
    return text


def _children(value: object) -> list[tuple[object, object]]:
    """(step, child) pairs of a container output: mappings, sequences, dataclasses, objects with
    `logits`."""
    if isinstance(value, Mapping):
        return [(k, v) for k, v in value.items() if isinstance(k, (str, int))]
    if isinstance(value, (tuple, list)):
        return list(enumerate(value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [(f.name, getattr(value, f.name, None)) for f in dataclasses.fields(value)]
    return []


def candidates(
    output: object, vocab: int | None, depth: int = 0
) -> list[tuple[Path, torch.Tensor]]:
    """Every floating tensor in `output` (depth-first, a `logits` entry first) whose last dimension
    is `vocab` (any with two or more dimensions when the vocabulary is unknown), with its path."""
    if isinstance(output, torch.Tensor):
        fits = (
            output.is_floating_point()
            and output.dim() >= 2
            and (vocab is None or output.shape[-1] == vocab)
        )
        return [((), output)] if fits else []
    if depth >= _MAX_DEPTH:
        return []
    kids = _children(output)
    named = (
        getattr(output, "logits", None) if not isinstance(output, Mapping) else output.get("logits")
    )
    if named is not None and not any(k == "logits" for k, _ in kids):
        kids.insert(0, ("logits", named))
    kids.sort(key=lambda kv: kv[0] != "logits")  # stable: a `logits` entry first, the rest in order
    out = []
    for step, child in kids:
        out += [((step, *path), t) for path, t in candidates(child, vocab, depth + 1)]
    return out


def logits_path(output: object, vocab: int | None, batch: int, seq: int) -> Path | None:
    """Where `output` (of a forward on batch × seq token ids) holds the logits of every position,
    if it does."""
    return _full(candidates(output, vocab), batch, seq)


def _full(found: list[tuple[Path, torch.Tensor]], batch: int, seq: int) -> Path | None:
    return next((path for path, t in found if tuple(t.shape[:-1]) == (batch, seq)), None)


def _describe(output: object) -> str:
    if isinstance(output, torch.Tensor):
        return f"a tensor of shape {tuple(output.shape)}"
    kids = _children(output)
    inner = ", ".join(
        f"{k}: {tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}"
        for k, v in kids[:6]
    )
    return f"{type(output).__name__} ({inner})" if kids else type(output).__name__


def forward_names(model: nn.Module) -> tuple[str | None, str | None]:
    """The forward's positions and targets parameters (by the names the field gives them), if it
    takes them."""
    try:
        names = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return None, None
    return next((n for n in POSITIONS if n in names), None), next(
        (n for n in TARGETS if n in names), None
    )


def discover(
    model: nn.Module, vocab: int | None, name: str, seq: int = 4, batch: int = 2
) -> Forward:
    """How to call `model` (any device: it runs on a meta twin) so that its output holds the logits
    of every position; a UsageError saying what it returns when no call does."""
    positions, targets = forward_names(model)
    twin = meta_twin(model)
    ids = torch.zeros((batch, seq), dtype=torch.long, device="meta")
    plain = Forward(positions=positions)
    try:
        output = plain.run(twin, ids)
    except Exception:  # noqa: BLE001 - the model's own code on meta tensors: the run's first forward will tell
        return Forward(positions=positions, read=False)
    found = candidates(output, vocab)
    path = _full(found, batch, seq)
    if path is not None:
        return Forward(positions=positions, path=path)
    if targets is not None:
        with_targets = Forward(positions=positions, targets=targets)
        try:
            path = _full(candidates(with_targets.run(twin, ids, ids), vocab), batch, seq)
        except Exception:  # noqa: BLE001 - as above
            path = None
        if path is not None:
            stop = producer(
                twin, lambda: with_targets.run(twin, ids, ids), lambda out: follow(out, path)
            )
            return Forward(positions=positions, targets=targets, path=path, stop=stop)
    what = _describe(output)
    if found:
        shape = tuple(found[0][1].shape)
        hint = (
            f"; called with `{targets}` it gives none either"
            if targets
            else "; dtp compares the logits of every position, so make the forward return them (nanoGPT returns them "
            "when it is given targets)"
        )
        raise UsageError(
            f"model {name} returns logits for only some positions ({show(found[0][0])} has shape "
            f"{shape} for {batch}×{seq} token ids){hint}"
        )
    raise UsageError(
        f"model {name}: its forward returns {clip(what, 200)}, with no tensor of logits over the "
        f"{vocab if vocab is not None else 'vocabulary'} tokens for every position "
        f"({batch}×{seq} token ids in); dtp needs the logits (a tensor, or a `logits` entry, or the "
        ""
        "first such tensor of a tuple, dict or dataclass)"
    )
