"""Check rule: the model's forward runs on the shapes one rank holds.

A plan can be consistent in every layout and still cut a tensor the model's own code sizes from
elsewhere: nanoGPT views its heads with `C // self.n_head`, where `C` comes from `x.size()`, the
block input's full width, so a rank holding half the heads has half the features and `view` fails
mid-run. Whether that happens is a question about the model's code, and the code can answer it: the
forward runs once on a fake twin of the model (dtp/layout/trace.py) whose split layers hold one
rank's slice of their weights (rank 0's, as `ParamPlacement.local_shape` gives it) and whose `set`
attributes hold their values at this tp — the shapes the hot path computes with, since the column
and row layers and the vocabulary-parallel head run on local tensors. If the unsharded forward runs
and this one raises, no run of the plan can succeed: that is a proof, reported at the rule that
split the module where it raised, with the model's own line.

Only what the twin models faithfully is run: `colwise`, `rowwise` and `vocab_parallel` on plain
`nn.Linear` and `nn.Embedding` (sequence parallelism, replicate and `set` as they are). A plan with
any other style on the way (slice_input, slice_params, experts, sharded_norm, a Linear subclass with
its own forward, transformers' Conv1D) is not run here; the runtime proof of `dtp apply` remains.
"""

from __future__ import annotations

import weakref

import torch.nn as nn
from torch.distributed.tensor import Shard

from dtp.checks.messages import Reporter
from dtp.lang.expr import ExprError
from dtp.layout.attention import attention_like, config_heads
from dtp.layout.depth import containers, shorten
from dtp.layout.lower import Lowered, lower, rewrite
from dtp.layout.resolve import Resolution, generic_path
from dtp.layout.styles import Style
from dtp.layout.trace import TRACES, Trace, model_trace, trace

_MODELLED = {"colwise", "rowwise", "vocab_parallel", "sequence_parallel", "replicate"}


def _modelled(res: Resolution, low: Lowered) -> bool:
    """Whether every rule of the plan is one the twin reproduces (see the module docstring)."""
    for path, rule in res.claims.items():
        if rule.style.name not in _MODELLED:
            return False
        module = res.modules[path]
        layout = low.modules.get(path)
        if layout is None or rule.style.name == Style.SEQUENCE_PARALLEL:
            continue
        if type(module).forward not in (nn.Linear.forward, nn.Embedding.forward):
            return False
    return True


def _local(res: Resolution, low: Lowered, tp: int, path: str) -> bool:
    """Whether module `path` computes on this rank's slice of its weights (rather than gathering
    them)."""
    layout = low.modules.get(path)
    if layout is None:
        return False
    if layout.style == Style.COLWISE:
        return isinstance(layout.output, Shard) and layout.local
    if layout.style == Style.ROWWISE:
        return isinstance(layout.input, Shard)
    return layout.style == Style.VOCAB_PARALLEL and not layout.embedding


# blocks kept per container: every block of one class runs the same code on the same shapes
_KEEP = 2


def _surplus(model: nn.Module) -> set[str]:
    """The blocks past the first _KEEP of each container of `model` that holds more than 4 × _KEEP
    (shortening a shallower one does not pay for its extra run)."""
    surplus: set[str] = set()
    for parent, paths in containers(model).items():
        if len(paths) <= 4 * _KEEP:
            continue
        holder = model.get_submodule(parent) if parent else model
        position = {name: i for i, name in enumerate(holder._modules)}
        surplus.update(p for p in paths if position[p.rpartition(".")[2]] >= _KEEP)
    return surplus


def _prepare(res: Resolution, low: Lowered, tp: int, dropped: set[str]):
    def prepare(twin: nn.Module, fake) -> None:
        shorten(twin, dropped)
        for path in res.claims:
            if _dropped(path, dropped) or not _local(res, low, tp, path):
                continue
            module = twin.get_submodule(path)
            placements = res.placements(path)
            for name, param in list(module.named_parameters(recurse=False)):
                shape = placements[name].local_shape(tuple(param.shape), tp)
                setattr(
                    module,
                    name,
                    nn.Parameter(fake(shape, param.dtype), requires_grad=param.requires_grad),
                )
        for path, values in low.rewrites.items():
            if not _dropped(path, dropped):
                rewrite(twin.get_submodule(path), values)

    return prepare


def _dropped(path: str, dropped: set[str]) -> bool:
    """Whether `path` or an ancestor of it is in `dropped`."""
    while path:
        if path in dropped:
            return True
        path = path.rpartition(".")[0]
    return False


# One rank's run by model and by what the twin changes: a plan checked again (auto's rounds, apply's
# pre-flight, every `when` branch) runs once. Held weakly, as TRACES holds the model's own trace.
_RUNS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, Trace]] = weakref.WeakKeyDictionary()


# The blocks a rank's run leaves out, by model (see _short).
_SHORT: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()


def _short(model: nn.Module) -> set[str]:
    """The blocks a rank's run of `model` leaves out: a deep model runs on its first blocks (the
    cost of a forward grows with depth, and every block of one class runs the same code on the same
    shapes), unless the shortened whole model cannot run (a forward that indexes its blocks by
    config.n_layer); the blocks left out are not copied into the twin either."""
    if model not in _SHORT:
        surplus = _surplus(model)
        leave = [model.get_submodule(p) for p in surplus]
        runs = (
            bool(surplus)
            and trace(
                model,
                TRACES.forward(model),
                prepare=lambda twin, fake: shorten(twin, surplus),
                leave=leave,
            ).ok
        )
        _SHORT[model] = surplus if runs else set()
    return _SHORT[model]


def _key(res: Resolution, low: Lowered, tp: int) -> tuple:
    """What the rank's twin differs from the model by: the local layers (path, style, local shapes)
    and rewrites."""
    local = tuple(
        sorted(
            (path, tuple(sorted((n, repr(p)) for n, p in res.placements(path).items())))
            for path in res.claims
            if _local(res, low, tp, path)
        )
    )
    return tp, local, tuple(sorted((p, tuple(sorted(v.items()))) for p, v in low.rewrites.items()))


def _owner(res: Resolution, where: str | None) -> str | None:
    """The claimed module nearest `where` (the module running when the forward raised): itself, one
    under it, or one under its nearest ancestor that has any."""
    path = where
    while path is not None:
        inside = [p for p in res.claims if p == path or p.startswith(path + ".") or not path]
        if inside:
            return inside[0]
        path = path.rpartition(".")[0] if path else None
    return None


def check_rank_shapes(res: Resolution, model: nn.Module, tp: int, rep: Reporter) -> Trace | None:
    """Run the forward on one rank's shapes (see the module docstring); report where it cannot run.
    Returns the sharded trace (None when the plan or the model is not one this check can run)."""
    if tp < 2:
        return None
    whole = model_trace(model)
    if whole is None or not whole.ok:
        return None
    try:
        low = lower(res, tp)
    # a `set` that does not divide at this tp: _check_sets says so where the tp is the user's
    except ExprError:
        return None
    if not _modelled(res, low):
        return None
    key = _key(res, low, tp)
    shard = _RUNS.setdefault(model, {}).get(key)
    if shard is None:
        dropped = _short(model)
        leave = [model.get_submodule(p) for p in dropped]
        shard = _RUNS[model][key] = trace(
            model, TRACES.forward(model), prepare=_prepare(res, low, tp, dropped), leave=leave
        )
    if shard.ok:
        return shard
    owner = _owner(res, shard.where)
    if owner is None:
        return shard
    rule = res.claims[owner]
    where = generic_path(shard.where or owner)
    line = (
        f"`{shard.frame.split(': ', 1)[1]}` ({shard.frame.split(': ', 1)[0]})"
        if shard.frame
        else "its forward"
    )
    cache = _head_buffers(model, shard.where or owner)
    held = (
        (
            f"; {cache} holds every head of the whole model (a cache set up before sharding, as "
            "gpt-fast's "
            "setup_caches makes it): dtp does not split buffers, so keep the attention whole or "
            "build the model "
            "without the cache"
        )
        if cache
        else ""
    )
    rep.add(
        rule.style.pos,
        len(rule.style.name),
        owner,
        f"at tp={tp} a rank's share cannot run through {where}: {line} raises {shard.error}, while "
        "the whole "
        "model runs; the forward sizes tensors with numbers each rank holds less of: a module "
        "attribute can be "
        f"rewritten (`set {where}.ATTR = ATTR / tp`), a width read from a tensor (`x.size()`) "
        "cannot; else keep "
        f"{where} whole (no colwise or rowwise rule inside it){held}",
    )
    return shard


def _head_buffers(model: nn.Module, path: str) -> str | None:
    """The buffer under attention `path` (or its nearest attention ancestor) with a dimension of the
    model's head count, named generically with that dimension: a KV cache sized for every head."""
    info = config_heads(model)
    while path and not attention_like(model.get_submodule(path)):
        path = path.rpartition(".")[0]
    if info is None or not path:
        return None
    counts = {info.n_kv_head, info.n_head}
    for name, buf in model.get_submodule(path).named_buffers():
        dims = [d for d, n in enumerate(buf.shape) if n in counts and d > 0]
        if buf.dim() >= 3 and dims:
            return f"{generic_path(path)}.{name} (dim {dims[0]}: {buf.shape[dims[0]]})"
    return None
