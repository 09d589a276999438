"""`dtp plan --auto` on hostile models: a forward whose source cannot be read is no evidence (its
layers' names are not either), a slow property is read a bounded number of times whatever the
number of blocks, and the work on a deep model grows with its kinds of module, not its blocks.

Counts, not seconds: how often the expensive readings run (a forward's source walked, the checker,
the trace, a walk of every module), never how long they take (timings belong in bench/).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from fixtures.auto_models import Attention, Block, Structure, build

import dtp.auto.planner as planner
import dtp.auto.structure as structure
import dtp.checks.rank_shapes as rank_shapes
from dtp.auto.planner import auto_plan
from dtp.errors import UsageError
from dtp.layout.trace import Traces

NO_SOURCE = "dtp splits only what a forward's source shows, never by the layers' names"
MLP_LINES = [
    "    mlp.gate_proj: colwise  # 64 hidden features: this rank's 32",
    "    mlp.up_proj: colwise  # 64 hidden features: this rank's 32",
    "    mlp.down_proj: rowwise  # partial sums over this rank's features, all-reduced",
]


def _exec_class(cls: type) -> type:
    """A subclass of `cls` whose forward is compiled from a string: no file holds its source."""
    namespace: dict = {}
    exec("def forward(self, x):\n    return base.forward(self, x)\n", {"base": cls}, namespace)
    return type(f"Exec{cls.__name__}", (cls,), {"forward": namespace["forward"]})


class LambdaAttention(Attention):
    # the case under test: a lambda as the forward
    forward = lambda self, x: Attention.forward(self, x)


class PartialAttention(Attention):
    forward = functools.partialmethod(Attention.forward)


def _unreadable(how: str) -> nn.Module:
    """The fixture's model (q/k/v apart, SwiGLU, 2 blocks) with every attention's forward made
    unreadable in one way."""
    model = build(Structure())
    for block in model.layers:
        if how == "exec":
            block.attn.__class__ = _exec_class(Attention)
        elif how == "lambda":
            block.attn.__class__ = LambdaAttention
        elif how == "partialmethod":
            block.attn.__class__ = PartialAttention
        else:  # the class's forward shows q, k, v → o_proj; what runs is v → o_proj alone
            attn = block.attn
            block.attn.forward = lambda x, attn=attn: attn.o_proj(attn.v_proj(x))
    return model


@pytest.mark.parametrize(
    ("how", "why"),
    [
        ("exec", "inspect.getsource finds none: a class made by exec or compiled code"),
        ("lambda", "a lambda"),
        ("partialmethod", "a partialmethod, not a Python function"),
        ("instance", "it is set on the instance, not by the class"),
    ],
)
def test_an_attention_whose_forward_has_no_source_stays_replicated(how, why):
    """Before, the projections' names (q_proj … o_proj) or the class's own forward decided the split
    where the forward that runs had no source to read."""
    found = auto_plan(_unreadable(how), f"unreadable-{how}", 2)
    reason = f"its forward's source cannot be read ({why}): {NO_SOURCE}"
    block = found.text.split("layers.* {\n", 1)[1].split("\n}", 1)[0].splitlines()
    assert block == [*MLP_LINES, f"    # attn stays replicated: {reason}"], found.text
    assert found.refused == (f"layers.*.attn: {reason}",)
    assert found.summary.startswith("blocks split 2/2, attention whole in 2, MLP whole in 0; ")
    assert found.checked_tp == (1, 2, 4, 8, 16, 32, 64)


def test_an_mlp_whose_forward_is_set_on_the_instance_stays_replicated():
    model = build(Structure(mlp="gelu"))
    for block in model.layers:
        mlp = block.mlp
        mlp.forward = lambda x, mlp=mlp: mlp.down_proj(torch.relu(mlp.up_proj(x)))
    found = auto_plan(model, "instance-mlp", 2)
    why = "it is set on the instance, not by the class"
    reason = f"its forward's source cannot be read ({why}): {NO_SOURCE}"
    assert f"    # mlp stays replicated: {reason}\n" in found.text
    assert "mlp.up_proj" not in found.text and "attn.o_proj: rowwise" in found.text
    assert found.summary.startswith("blocks split 2/2, attention whole in 0, MLP whole in 2; ")


class Experts(nn.Module):
    """Every expert's SwiGLU as 3-D parameters in transformers' layout, gate_up_proj (E, 2·I, H) and
    down_proj (E, H, I); the experts' outputs averaged."""

    def __init__(self, n: int = 2, hidden: int = 32, inter: int = 16):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(n, 2 * inter, hidden) / hidden**0.5)
        self.down_proj = nn.Parameter(torch.randn(n, hidden, inter) / inter**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = torch.einsum("bth,eih->ebti", x, self.gate_up_proj).chunk(2, dim=-1)
        y = torch.einsum("ebti,ehi->bth", F.silu(gate) * up, self.down_proj)  # (B, T, H)
        return y / self.gate_up_proj.shape[0]


@pytest.mark.parametrize("readable", [True, False])
def test_experts_whose_forward_has_no_source_stay_replicated(readable):
    """Experts are found by their parameters' names and shapes; without the forward's source,
    those are no evidence of how it computes."""
    model = build(Structure())
    for block in model.layers:
        block.mlp = Experts() if readable else _exec_class(Experts)()
    found = auto_plan(model, "experts", 2)
    line = next(x for x in found.text.splitlines() if x.startswith(("    mlp", "    # mlp")))
    if readable:
        assert line.startswith("    mlp: experts  # 2 experts, gate_up_proj (E, 2·I, H)"), line
    else:
        why = "inspect.getsource finds none: a class made by exec or compiled code"
        reason = f"its forward's source cannot be read ({why}): {NO_SOURCE}"
        assert line == f"    # mlp stays replicated: {reason}"


class LoopAttention(Attention):
    """Calls its projections by name in a loop: the source, read, does not show the flow."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (
            getattr(self, name)(x).reshape(B, T, -1, self.head_dim).transpose(1, 2)
            for name in ("q_proj", "k_proj", "v_proj")
        )
        y = torch.softmax(q @ k.transpose(-1, -2), -1) @ v  # (B, nh, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class Untraceable(nn.Module):
    """The fixture's model behind a forward that reads a token's value (`.item()`): no forward on
    fake tensors runs it."""

    def __init__(self):
        super().__init__()
        self.inner = build(Structure())
        self.config = self.inner.config
        for block in self.inner.layers:
            block.attn.__class__ = LoopAttention

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.max().item() >= self.config.vocab_size:
            raise ValueError("token out of range")
        return self.inner(input_ids)


def test_names_do_not_stand_in_for_a_flow_neither_the_source_nor_a_run_shows():
    """Before, q_proj/k_proj/v_proj colwise and o_proj rowwise "by elimination"."""
    found = auto_plan(Untraceable(), "untraceable", 2)
    assert (
        "    # attn stays replicated: its linear layers form no colwise → rowwise pair that its "
        "forward shows (e.g. low-rank or latent projections, or a forward dtp could neither read "
        "nor run)\n" in found.text
    ), found.text
    assert "q_proj" not in found.text and "mlp.down_proj: rowwise" in found.text


class _Calls:
    """Calls of the expensive readings and reads of slow properties, by name, made by the planner
    itself: what `dtp check` reads while it judges a plan is its own (it is counted as one call)."""

    def __init__(self, monkeypatch, model: nn.Module):
        self.n: dict[str, int] = {}
        self.checking = False
        monkeypatch.setattr(structure, "forward_facts", self._counted(structure.forward_facts))
        monkeypatch.setattr(Traces, "of", self._counted(Traces.of, "trace"))
        check = planner.check

        def checking(*args, **kwargs):
            self.count("check")
            self.checking = True
            try:
                return check(*args, **kwargs)
            finally:
                self.checking = False

        monkeypatch.setattr(planner, "check", checking)
        walk = nn.Module.named_modules

        def named_modules(module, *args, **kwargs):
            if module is model:
                self.count("walks")
            return walk(module, *args, **kwargs)

        monkeypatch.setattr(nn.Module, "named_modules", named_modules)

    def count(self, name: str) -> None:
        if not self.checking:
            self.n[name] = self.n.get(name, 0) + 1

    def _counted(self, fn, name: str = ""):
        name = name or fn.__name__

        def counted(*args, **kwargs):
            self.count(name)
            return fn(*args, **kwargs)

        return counted


class SlowConfig:
    """The fixture's config with its head count behind a property that stands for a slow one (a
    lookup on a remote store): each read is counted."""

    def __init__(self, config: object, calls: _Calls):
        self.__dict__.update(vars(config))
        self._heads, self.calls = self.__dict__.pop("num_attention_heads"), calls

    @property
    def num_attention_heads(self) -> int:
        self.calls.count("config property")
        return self._heads


class SlowAttention(Attention):
    calls: _Calls

    @property
    def num_heads(self) -> int:
        self.calls.count("attention property")
        return 4


def test_a_slow_property_is_read_a_bounded_number_of_times(monkeypatch):
    """The config's head count and an attention's `num_heads` as properties: the planner reads the
    config's for the model once (dtp/layout/attention.py's config reader asks twice), the modules'
    never (attributes are read as stored), however many blocks and tp values it plans for."""
    seen = {}
    for n_blocks in (2, 12):
        model = _deep(n_blocks)
        calls = _Calls(monkeypatch, model)
        model.config = SlowConfig(model.config, calls)
        slow = type("SlowAttention", (SlowAttention,), {"calls": calls})
        for block in model.layers:
            block.attn.__class__ = slow
        found = auto_plan(model, f"slow-{n_blocks}", 2)
        monkeypatch.undo()
        assert found.checked_tp == (1, 2, 4), found.text
        seen[n_blocks] = calls.n
    # walks: the planner's one, and the share of the bytes that stay whole
    expected = {"walks": 2, "forward_facts": 2, "check": 3, "config property": 2}
    assert seen == {2: expected, 12: expected}


def _deep(n_blocks: int) -> nn.Module:
    s = Structure()
    with torch.device("meta"):
        model = build(s)
        model.layers = nn.ModuleList(Block(s) for _ in range(n_blocks))
    return model


def test_the_work_grows_with_the_kinds_of_module_not_the_blocks(monkeypatch):
    """2 blocks and 16, with the real checker: the same count of every expensive reading (a walk of
    the modules to read them, one to sum the bytes left whole; the forward's source walked once per
    kind of module; the checker once at tp 2 and once for each other tp it may claim, 1 and 4; no
    trace: every source shows its pair)."""
    seen = {}
    for n_blocks in (2, 16):
        model = _deep(n_blocks)
        calls = _Calls(monkeypatch, model)
        found = auto_plan(model, "deep", 2)
        monkeypatch.undo()
        assert found.checked_tp == (1, 2, 4) and "layers.* {" in found.text
        seen[n_blocks] = calls.n
    expected = {"walks": 2, "forward_facts": 2, "check": 3}
    assert seen == {2: expected, 16: expected}


def test_two_thousand_blocks_are_read_once(monkeypatch):
    """The planner alone on 2,000 blocks (the checker stands in and accepts every plan: its own
    cost is its own): one walk of the modules, each kind of module's source walked once, and each
    other tp tried on one block before all of them."""
    model = _deep(2000)
    every_tp = SimpleNamespace(admissible_tp=tuple(range(1, 65)))
    monkeypatch.setattr(planner, "check", lambda plan, model, tp: every_tp)
    monkeypatch.setattr(planner, "replicated_fraction", lambda checked, model: 0.0)
    calls = _Calls(monkeypatch, model)
    units, tried = planner.block_units, []

    def block_units(reading, path, tp, sp=False):
        tried.append(path)
        return units(reading, path, tp, sp)

    monkeypatch.setattr(planner, "block_units", block_units)
    found = auto_plan(model, "deep-2000", 2)
    assert found.checked_tp == (1, 2, 4)
    assert found.summary == (
        "blocks split 2000/2000, attention whole in 0, MLP whole in 0; 0.0 % of the parameter "
        "bytes stay whole on every rank"
    )
    assert calls.n == {"walks": 1, "forward_facts": 2, "check": 3}
    # 2,000 at tp 2; then one block for each of the 63 other tp values, all 2,000 at tp 1 and 4
    assert len(tried) == 2000 + 63 + 2 * 2000


def test_a_model_past_the_bound_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(structure, "MAX_MODULES", 40)
    with pytest.raises(UsageError) as err:
        auto_plan(_deep(8), "deep", 2)
    assert str(err.value) == (
        "dtp plan --auto reads at most 40 modules and this model holds more: write its plan by "
        "hand, one rule per kind of block (`layers.*`)"
    )


def test_a_deep_model_runs_its_ranks_on_two_blocks_and_copies_no_other(monkeypatch):
    """12 blocks: one run finds the model runs on its first two, then one run for each tp checked
    (2 and 4) holds those two; every run leaves blocks 2-11 themselves out of its twin (no copy of
    what it would throw away)."""
    model = _deep(12)
    left_out = []
    traced = rank_shapes.trace

    def trace(*args, leave=(), **kwargs):
        left_out.append(list(leave))
        return traced(*args, leave=leave, **kwargs)

    monkeypatch.setattr(rank_shapes, "trace", trace)
    found = auto_plan(model, "deep", 2)
    assert found.checked_tp == (1, 2, 4)
    assert len(left_out) == 3
    rest = {id(block) for block in model.layers[2:]}
    assert all(len(leave) == 10 and {id(m) for m in leave} == rest for leave in left_out)
