"""What a model's forward really does, observed: one forward on fake tensors, every tensor tagged
with the modules whose outputs it comes from.

Reading a forward's source (dtp/layout/forward_source.py) cannot follow a `match` on a config
string, a lambda built in `__init__` (minGPT's `self.mlpf`), blocks held in a ModuleDict
(torchtitan), a helper function, a `functools.partial`. Running the forward can: module hooks see
every call however it is reached, and a TorchFunctionMode carries each tensor's origins through
every op. It runs on a twin of the model whose tensors are meta tensors (shapes and dtypes, no
memory, no data) or, where the forward cannot run on those, fakes (torch's FakeTensorMode: the
same, on the model's device; transformers reads it as tracing and skips its data-dependent checks),
and whose Python state is a copy, so a forward that counts its calls or fills a cache changes the
twin only, never the model.

What one forward shows (only the branches this config takes; a branch not taken is not seen):
- `order`: modules in the order they were first called;
- `edges[leaf]`: the leaf modules (no children) whose outputs reach a leaf's inputs without passing
  another leaf; `inputs[path]`, `outputs[path]` the same for any module's inputs and outputs ("" is
  the model's input);
- a tensor that sums many modules' outputs (the residual stream of a deep model: layer i's carries 2i
  of them) is tagged with a junction instead, a node named under the module running the op whose
  edges hold those tags (`nearest` walks through it like a leaf it does not stop at): without it the
  tag sets, and the time and memory of a trace, grow with the square of the depth (20,000 blocks ran
  out of 23 GB);
- `views[linear]`: how the forward cut a linear layer's output into heads, per contiguous part of
  its features: `View(offset, width, heads, head_dim)` (gpt-fast's `wqkv(x).split([dim, kv, kv])`
  then `view(…, n, head_dim)`).

A forward that cannot run on fake tensors either (data-dependent Python, an op without a fake
kernel) gives a Trace with `error` set and nothing else; callers fall back to the source, and say
so.
"""

from __future__ import annotations

import logging
import traceback
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Callable, Collection

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from dtp.errors import UsageError
from dtp.layout import depth
from dtp.layout.forward_source import BranchSources
from dtp.models.calling import PLAIN, Forward, discover, forward_names, logits_path
from dtp.models.clone import clone, meta_twin
from dtp.models.spec import vocab_size

INPUT = ""  # the tag of the model's own input (the token ids)
_SPLITS = {"split", "split_with_sizes", "chunk", "tensor_split", "unbind"}
_VIEWS = {"view", "reshape", "unflatten"}
_MAX_NEST = 4  # containers searched for tensors in a module's inputs and outputs
_BATCH, _SEQ = 2, 4  # the token ids a model's own trace and its discovery run on
# tags a tensor carries before they become one junction: above any block's own (a model of ~30
# blocks never reaches it), far below a deep model's residual stream
MAX_TAGS = 64
JUNCTION = "\0junction"  # a junction's name under its module: no module is named so


@dataclass(frozen=True)
class View:
    """A contiguous part of a linear layer's output features that the forward viewed as (heads,
    head_dim)."""

    offset: int
    width: int
    heads: int
    head_dim: int


@dataclass
class Trace:
    """One forward's data flow between modules (see the module docstring); `error` when it could not
    run."""

    order: list[str] = field(default_factory=list)
    edges: dict[str, set[str]] = field(default_factory=dict)
    inputs: dict[str, set[str]] = field(default_factory=dict)
    outputs: dict[str, set[str]] = field(default_factory=dict)
    views: dict[str, set[View]] = field(default_factory=dict)
    error: str | None = None
    where: str | None = None  # the innermost module running when the forward raised
    frame: str | None = None  # the model's own source line that raised ("file:line: code")
    meta: bool = False  # it ran on meta tensors (not on fakes)

    _ranks: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        """Whether the forward ran to its end."""
        return self.error is None

    def rank(self, path: str) -> int:
        """Where `path` comes in `order` (first call first)."""
        if len(self._ranks) != len(self.order):
            self._ranks.clear()
            self._ranks.update((p, i) for i, p in enumerate(self.order))
        return self._ranks[path]

    def called(self, path: str) -> bool:
        """Whether module `path` ran in this forward."""
        return path in self.inputs

    def nearest(self, tags: set[str], among: set[str], inside: str) -> tuple[frozenset[str], bool]:
        """The modules of `among` whose outputs reach `tags` first (through leaves not in `among`
        that sit under `inside`), and whether anything from outside `inside` (its input) reaches
        them too."""
        hits: set[str] = set()
        outside = False
        seen: set[str] = set()
        stack = list(tags)
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            owner = (
                node
                if node in among
                else next((a for a in among if node.startswith(a + ".")), None)
            )
            # a member's output (or, for a member with children, one of theirs)
            if owner is not None:
                hits.add(owner)
            elif node != INPUT and (not inside or node.startswith(inside + ".")):
                stack += list(self.edges.get(node, ()))
            else:
                outside = True
        return frozenset(hits), outside


class _Recorder(TorchFunctionMode):
    """Carries tags through every torch function call and notes where linear outputs are cut into
    heads."""

    def __init__(self, trace: Trace):
        super().__init__()
        self.trace = trace
        self.tags: dict[int, frozenset[str]] = {}
        # tensor id → (linear path, offset, width) of its features
        self.parts: dict[int, tuple[str, int, int]] = {}
        # every tagged tensor stays alive, so no id is reused during the forward
        self.keep: list[object] = []
        self.clock = 0  # ops and module calls so far
        # tensor id → the clock when an op or module last read it
        self.last_read: dict[int, int] = {}
        # (module, clock, its tensors), non-leaves
        self.results: list[tuple[str, int, list[torch.Tensor]]] = []
        self.stack: list[str] = []  # the modules running, innermost last
        self.junctions = 0

    def read(self, value: object) -> None:
        """Note the tensors in `value` as read now."""
        self.clock += 1
        for t in _tensors(value):
            self.last_read[id(t)] = self.clock

    def settle(self, final: object) -> None:
        """A module's result is what was read of it afterwards (HF attention also returns its
        weights, which the block drops); the model's own output counts as read."""
        self.read(final)
        for path, when, returned in self.results:
            read = [t for t in returned if self.last_read.get(id(t), 0) > when] or returned
            self.trace.outputs.setdefault(path, set()).update(self.tag_of(read))

    def tag_of(self, value: object, depth: int = 0) -> frozenset[str]:
        if isinstance(value, torch.Tensor):
            return self.tags.get(id(value), frozenset())
        if depth >= _MAX_NEST:
            return frozenset()
        if isinstance(value, (tuple, list)):
            return frozenset().union(*(self.tag_of(v, depth + 1) for v in value))
        if isinstance(value, Mapping):
            return frozenset().union(*(self.tag_of(v, depth + 1) for v in value.values()))
        return frozenset()

    def set_tag(self, value: object, tags: frozenset[str], merge: bool) -> None:
        for t in _tensors(value):
            held = (self.tags.get(id(t), frozenset()) | tags) if merge else tags
            self.tags[id(t)] = self._junction(held) if len(held) > MAX_TAGS else held
            self.keep.append(t)

    def _junction(self, tags: frozenset[str]) -> frozenset[str]:
        """One node standing for `tags`, named under the module running now."""
        self.junctions += 1
        scope = self.stack[-1] if self.stack else ""
        name = f"{scope}.{JUNCTION}{self.junctions}" if scope else f"{JUNCTION}{self.junctions}"
        self.trace.edges[name] = set(tags)
        return frozenset({name})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.read((args, kwargs))
        tags = self.tag_of(args) | self.tag_of(kwargs)
        if tags:
            self.set_tag(out, tags, merge=True)
        if args and isinstance(args[0], torch.Tensor) and id(args[0]) in self.parts:
            self._cut(getattr(func, "__name__", ""), args, kwargs, out)
        return out

    def _cut(self, name: str, args: tuple, kwargs: dict, out: object) -> None:
        """Follow a linear output's features through splits and slices to the view that makes heads
        of them."""
        x = args[0]
        path, offset, width = self.parts[id(x)]
        lead = tuple(x.shape[:-1])
        if name in _SPLITS and isinstance(out, (tuple, list)):
            pieces = [t for t in out if isinstance(t, torch.Tensor)]
            if (
                len(pieces) == len(out)
                and all(tuple(t.shape[:-1]) == lead for t in pieces)
                and sum(t.shape[-1] for t in pieces) == x.shape[-1]
            ):
                for t in pieces:
                    self.parts[id(t)] = (path, offset, t.shape[-1])
                    offset += t.shape[-1]
        elif name in _VIEWS and isinstance(out, torch.Tensor) and out.dim() == x.dim() + 1:
            if (
                tuple(out.shape[:-2]) == lead
                and out.shape[-2] * out.shape[-1] == x.shape[-1] == width
            ):
                self.trace.views.setdefault(path, set()).add(
                    View(offset, width, out.shape[-2], out.shape[-1])
                )
        elif (
            name in ("__getitem__", "narrow")
            and isinstance(out, torch.Tensor)
            and tuple(out.shape[:-1]) == lead
        ):
            start = _last_dim_start(name, args, x.dim())
            if start is not None:
                self.parts[id(out)] = (path, offset + start, out.shape[-1])


def _tensors(value: object, depth: int = 0) -> list[torch.Tensor]:
    """The tensors in `value` (nested tuples, lists, dicts and dataclasses)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if depth >= _MAX_NEST:
        return []
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v, depth + 1)]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors(v, depth + 1)]
    if hasattr(value, "__dataclass_fields__"):
        return [
            t
            for name in value.__dataclass_fields__
            for t in _tensors(getattr(value, name, None), depth + 1)
        ]
    return []


def _last_dim_start(name: str, args: tuple, ndim: int) -> int | None:
    """Where a slice of the last dimension starts (`x[..., a:b]`, `x[:, :, a:b]`, `x.narrow(-1, a,
    n)`)."""
    if name == "narrow":
        dim, start = (args[1], args[2]) if len(args) >= 3 else (None, None)
        return start if dim in (-1, ndim - 1) and isinstance(start, int) else None
    index = args[1] if len(args) > 1 else None
    index = index if isinstance(index, tuple) else (index,)
    if not index or not isinstance(index[-1], slice) or index[-1].step not in (None, 1):
        return None
    if not (len(index) == ndim or (Ellipsis in index and index.index(Ellipsis) == len(index) - 2)):
        return None
    if any(i is not Ellipsis and i != slice(None) for i in index[:-1]):
        return None
    start = index[-1].start or 0
    return start if isinstance(start, int) and start >= 0 else None


Prepare = Callable[[nn.Module, Callable[[tuple[int, ...], torch.dtype], torch.Tensor]], None]


def trace(
    model: nn.Module,
    forward: Forward = PLAIN,
    batch: int = 2,
    seq: int = 4,
    prepare: Prepare | None = None,
    leave: Collection[nn.Module] = (),
    seen: Callable[[object], None] | None = None,
) -> Trace:
    """Run `model`'s forward once on fakes of its tensors, token ids (batch, seq) in; what it did
    (see Trace). `prepare(twin, fake)`, when given, changes the twin first (`fake(shape, dtype)`
    makes a tensor of its kind); the modules in `leave` are not copied into the twin, and
    `prepare` takes them out of it; `seen(output)`, when given, receives the forward's output.

    It runs on meta tensors first (torch's meta kernels run in C++, a few times faster than
    FakeTensorMode's Python dispatch: it decides how long a deep model takes to check), with meta
    the default device, so that a tensor the forward makes without naming a device is meta too; a
    forward that cannot run so (a tensor made on a named device, a data-dependent branch that
    transformers skips only under FakeTensorMode) runs again on fakes, and that run is the trace."""
    fast = _run(model, forward, batch, seq, prepare, leave, seen, meta=True)
    return fast if fast.ok else _run(model, forward, batch, seq, prepare, leave, seen, meta=False)


def _run(
    model: nn.Module,
    forward: Forward,
    batch: int,
    seq: int,
    prepare: Prepare | None,
    leave: Collection[nn.Module],
    seen: Callable[[object], None] | None,
    meta: bool,
) -> Trace:
    out = Trace(meta=meta)
    mode = torch.device("meta") if meta else FakeTensorMode(allow_non_fake_inputs=True)
    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    # it logs every op without a fake kernel before raising
    level, quiet.level = quiet.level, logging.CRITICAL
    try:
        twin = (
            meta_twin(model, leave)
            if meta
            else clone(model, lambda t: mode.from_tensor(t, static_shapes=True), leave)
        )
    except Exception as err:  # noqa: BLE001 - a model whose state cannot be copied: no trace, the source is read
        quiet.level = level
        out.error = f"cannot copy the model to trace it: {type(err).__name__}: {err}"
        return out
    device = (
        torch.device("meta")
        if meta
        else next((t.device for t in model.parameters()), torch.device("cpu"))
    )
    if prepare is not None:

        def fake(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            with mode:  # a fake tensor: no memory, whatever the shape
                return torch.empty(shape, dtype=dtype, device=device)

        prepare(twin, fake)
    recorder = _Recorder(out)
    stack = recorder.stack
    handles = []
    for path, module in twin.named_modules():
        handles.append(
            module.register_forward_pre_hook(_pre(path, recorder, stack), with_kwargs=True)
        )
        handles.append(
            module.register_forward_hook(
                _post(path, recorder, stack, not any(module.children()), module)
            )
        )
    try:
        with mode, recorder:
            ids = torch.zeros((batch, seq), dtype=torch.long, device=device)
            recorder.set_tag(ids, frozenset({INPUT}), merge=False)
            output = forward.run(twin, ids, ids)
            recorder.settle(output)
        if seen is not None:
            seen(output)
    except Exception as err:  # noqa: BLE001 - the model's own code on fake tensors; the runtime proof remains
        out.error = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
        out.where = stack[-1] if stack else None
        out.frame = model_frame(err)
    finally:
        quiet.level = level
        for h in handles:
            h.remove()
    return out


def model_frame(err: BaseException) -> str | None:
    """The innermost frame of `err`'s traceback in the model's own code (not torch's, not dtp's), as
    "file:line: source"."""
    frames = [
        f
        for f in traceback.extract_tb(err.__traceback__)
        if "/torch/" not in f.filename
        and "/dtp/" not in f.filename
        and not f.filename.startswith("<")
    ]
    if not frames:
        return None
    f = frames[-1]
    return f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}: {(f.line or '').strip()}"


def _pre(path: str, rec: _Recorder, stack: list[str]):
    def hook(module, args, kwargs):
        stack.append(path)
        if path not in rec.trace.inputs:
            rec.trace.order.append(path)
        rec.trace.inputs.setdefault(path, set()).update(rec.tag_of(args) | rec.tag_of(kwargs))
        rec.read((args, kwargs))
        return None

    return hook


def _post(path: str, rec: _Recorder, stack: list[str], leaf: bool, module: nn.Module):
    def hook(mod, args, output):
        if stack and stack[-1] == path:
            stack.pop()
        if not leaf:
            rec.results.append((path, rec.clock, _tensors(output)))
            rec.keep.append(output)
            return None
        produced = rec.tag_of(args)
        rec.trace.edges.setdefault(path, set()).update(produced)
        rec.trace.outputs.setdefault(path, set()).add(path)
        if isinstance(output, torch.Tensor) and any(output is a for a in args):
            # an identity (dropout in eval): tag a new tensor, not the input
            output = output.view_as(output)
        rec.set_tag(output, frozenset({path}), merge=False)
        width = getattr(module, "out_features", None)
        if (
            isinstance(output, torch.Tensor)
            and isinstance(width, int)
            and output.dim() >= 2
            and output.shape[-1] == width
        ):
            rec.parts[id(output)] = (path, 0, width)
        return output

    return hook


class Traces:
    """Traces by model, held weakly: a model is traced once however often it is checked (check,
    `plan --auto`'s rounds, apply's pre-flight), and a model that is gone takes its trace with it."""

    def __init__(self) -> None:
        self._by_model: weakref.WeakKeyDictionary[nn.Module, tuple[Forward, Trace]] = (
            weakref.WeakKeyDictionary()
        )
        self._calls: weakref.WeakKeyDictionary[nn.Module, Forward | None] = (
            weakref.WeakKeyDictionary()
        )

    def calling(self, model: nn.Module, name: str) -> Forward:
        """How to call `model` for every position's logits (`dtp.models.calling.discover`, once per
        model); a UsageError naming the model as `name` when no call gives them."""
        if self._calls.get(model) is None:
            try:
                self._calls[model] = discover(model, vocab_size(model), name, _SEQ, _BATCH)
            except UsageError:
                self._calls[model] = None
                raise
        return self._calls[model]  # type: ignore[return-value]

    def _get(self, model: nn.Module) -> tuple[Forward, Trace]:
        hit = self._by_model.get(model)
        if hit is None:
            hit = self._by_model[model] = self._first(model)
        return hit

    def _first(self, model: nn.Module) -> tuple[Forward, Trace]:
        """How to call `model` and its trace. A trace on meta tensors of the plain call is the run
        `discover` makes first: where its output holds every position's logits, it is the discovery
        too (one forward of a deep model, not two)."""
        cut = depth.short(model)
        if model not in self._calls:
            positions, _ = forward_names(model)
            plain = Forward(positions=positions)
            outputs: list[object] = []
            tr = _traced(model, plain, cut, seen=outputs.append)
            if tr.ok and tr.meta:
                path = logits_path(outputs[-1], vocab_size(model), _BATCH, _SEQ)
                if path is not None:
                    self._calls[model] = replace(plain, path=path)
                    return self._calls[model], tr
        try:
            forward = self.calling(model, "model")
        # a model dtp cannot call: traced plainly; apply says why before launch
        except UsageError:
            forward = PLAIN
        return forward, _traced(model, forward, cut)

    def has(self, model: nn.Module) -> bool:
        """Whether `model` was traced already."""
        return model in self._by_model

    def of(self, model: nn.Module) -> Trace:
        """The trace of `model`, called as `dtp.models.calling.discover` says."""
        return self._get(model)[1]

    def forward(self, model: nn.Module) -> Forward:
        """How the trace called `model`."""
        return self._get(model)[0]


def _traced(
    model: nn.Module,
    forward: Forward,
    cut: depth.Short,
    seen: Callable[[object], None] | None = None,
) -> Trace:
    """The trace of `model` called as `forward`: a deep model's from its first blocks
    (dtp/layout/depth.py) where the model runs on them (a forward that indexes its blocks by
    config.n_layer does not), else of the whole model."""
    if cut.dropped:
        dropped = cut.paths()
        tr = trace(
            model,
            forward,
            _BATCH,
            _SEQ,
            prepare=lambda twin, fake: depth.shorten(twin, dropped),
            leave=[model.get_submodule(p) for p in dropped],
            seen=seen,
        )
        if tr.ok:
            return depth.expand(tr, cut)
    return trace(model, forward, _BATCH, _SEQ, seen=seen)


# facts about model objects, kept as long as the models live (as functools caches parsed sources)
TRACES = Traces()


def model_trace(model: nn.Module) -> Trace | None:
    """The trace of `model` (TRACES), or None for a model already sharded (its DTensors are not the
    model's shapes)."""
    if not TRACES.has(model) and isinstance(next(iter(model.parameters()), None), DTensor):
        return None
    return TRACES.of(model)


def branch_flow(tr: Trace, leaves: list[str]) -> BranchSources | None:
    """`leaves` (the paths of one branch, children of one module) as the trace saw them run: each
    leaf's inputs from the other leaves (none: the branch's own input), the leaves the parent's
    result comes from, in the order they ran; leaves that never ran are left out. None when the
    trace did not run or the parent was not called."""
    parent = leaves[0].rpartition(".")[0] if leaves else ""
    if (
        not tr.ok
        or not parent
        or any(p.rpartition(".")[0] != parent for p in leaves)
        or not tr.called(parent)
    ):
        return None
    ran = sorted((p for p in leaves if tr.called(p)), key=tr.rank)
    if not ran:
        return None
    among = set(ran)
    reads = []
    for path in ran:
        hits, _ = tr.nearest(tr.edges.get(path, tr.inputs.get(path, set())), among - {path}, parent)
        reads.append((path, tuple(p for p in ran if p in hits)))
    result, _ = tr.nearest(tr.outputs.get(parent, set()), among, parent)
    if not result:
        return None
    return BranchSources(parent, tuple(reads), tuple(p for p in ran if p in result))
