"""Layout flow: follow every activation's layout through the model, in module order, before any rank
starts.

A plan sets layouts at module boundaries (colwise hands on a local slice of the features, rowwise
its reduced sum, sequence_parallel a sequence-sharded DTensor); between them the model's own code
runs on whatever arrives. The walk follows the shape every transformer has: a top-level chain
(embeddings, the blocks, the final norm, the head) carrying the residual stream into every block (a
child of a ModuleList); inside a block the norms read the residual stream, and each branch (a child
container: attention, MLP) starts from it and adds its result back. Inside a branch each leaf reads
what the forward's source says it reads (dtp/layout/forward_source.py: q, k and v side by side,
their outputs meeting before o_proj); where the source cannot say, modules run in registration
order.

What it catches, each of which torch finds only mid-run or never:
- a colwise output that no rowwise consumes (it reaches a plain module, or leaves its branch a
  slice);
- `output=partial` sums that nothing reduces;
- a local tensor a consumer reads with another layout, a DTensor reaching a plain module or a plain
  residual stream (`local=` mismatches);
- sequence parallelism that leaves a norm or dropout of the residual stream out.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch.nn as nn

from dtp.checks.activations import PLAIN, Act, layout_text
from dtp.checks.flow_sources import meet_by_source
from dtp.errors import NOWHERE, Pos
from dtp.layout.attention import attention_like
from dtp.layout.blocks import ancestors, blocks
from dtp.layout.forward_source import branch_sources
from dtp.layout.norms import is_norm
from dtp.layout.resolve import Resolution
from dtp.layout.styles import Style
from dtp.layout.trace import Trace, branch_flow

Report = Callable[[Pos, int, str, str], None]  # (position, length, module path, message)


def _relevant(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, nn.Embedding, nn.Dropout)) or is_norm(module)


def _execution_order(leaves: list[str], style_of: Callable[[str], str | None]) -> list[str]:
    """Registration order, except a branch's one rowwise layer registered before its colwise layers
    (Phi-3's o_proj precedes qkv_proj) or before the sharded norms of their outputs (OLMo2's q_norm,
    k_norm follow o_proj): it runs after them, so it is walked right after the last one."""
    inner = ("colwise", "sharded_norm")
    cols = [i for i, p in enumerate(leaves) if style_of(p) in inner]
    rows = [i for i, p in enumerate(leaves) if style_of(p) == Style.ROWWISE]
    norms_after = (
        any(style_of(p) == Style.SHARDED_NORM for p in leaves[rows[0] :])
        if len(rows) == 1
        else False
    )
    if len(rows) != 1 or not cols or (rows[0] > cols[0] and not norms_after):
        return leaves
    row = leaves[rows[0]]
    rest = [p for p in leaves if p != row]
    last = max(i for i, p in enumerate(rest) if style_of(p) in inner)
    return rest[: last + 1] + [row] + rest[last + 1 :]


class _Walk:
    """One pass over the model; reports problems through `report` and stops where one makes the rest
    moot."""

    def __init__(
        self,
        res: Resolution,
        layouts: Mapping[str, object],
        sp: bool,
        vocab: int | None,
        report: Report,
        trace: Trace | None = None,
    ):
        self.res, self.layouts, self.sp, self.vocab, self.report = res, layouts, sp, vocab, report
        self.sp_rule = next(
            (
                r
                for r in sorted(res.claims.values(), key=lambda r: (r.pos.line, r.pos.column))
                if r.style.name == Style.SEQUENCE_PARALLEL
            ),
            None,
        )
        self.block_paths = blocks(res.modules)
        self.block_set = set(self.block_paths)
        self.trace = trace

    # ---- reporting ----------------------------------------------------------------------------------

    def rel(self, path: str, anchor: str | None) -> str:
        """`path` relative to the block that holds `anchor` too (so one message fits every layer)."""
        for block in self.block_paths:
            if anchor and path.startswith(block + ".") and anchor.startswith(block + "."):
                return path[len(block) + 1 :]
        return path or "the model"

    def fail(self, subject: str, message: str, *candidates: str | None) -> None:
        """Report at the rule of the first claimed candidate (else the first sequence_parallel
        rule)."""
        rule = (
            next((self.res.claims[c] for c in candidates if c and c in self.res.claims), None)
            or self.sp_rule
        )
        if rule is None:
            rule = min(
                self.res.claims.values(), key=lambda r: (r.pos.line, r.pos.column), default=None
            )
        pos, length = (rule.style.pos, len(rule.style.name)) if rule else (NOWHERE, 1)
        self.report(pos, length, subject, message)

    def style(self, path: str) -> str | None:
        m = self.layouts.get(path)
        return m.style if m is not None else None

    # ---- one module ---------------------------------------------------------------------------------

    def _expect(self, path: str, want: str, got: Act) -> bool:
        """A ParallelStyle redistributes a DTensor input, but reads a local one as `want`."""
        if got.dtensor or got.layout == want:
            return True
        style = self.style(path)
        src = f"{self.rel(got.producer, path)}" if got.producer else "the model's own computation"
        hint = ""
        if style == Style.ROWWISE and want == "shard(-1)" and got.layout == Style.REPLICATE:
            hint = (
                "; no colwise layer before it slices the features: shard the layer that produces "
                "its input "
                "colwise, or use rowwise(input=replicate)"
            )
            if got.producer and self.style(got.producer) == Style.COLWISE:
                hint = f"; drop output=replicate from {src} (rowwise consumes its slice) or use rowwise(input=replicate)"
        elif got.layout == Style.REPLICATE and want == "shard(1)":
            hint = "; it is not sequence-sharded here: drop input=shard(1), or shard the sequence before it"
        self.fail(
            path,
            f"{style} reads a local input as {want}, but receives {got.describe()} from "
            f"{src}{hint}",
            path,
        )
        return False

    def _plain(self, path: str, got: Act) -> bool:
        """A module no rule shards takes only the full activation as a plain tensor."""
        if not got.dtensor and got.layout == Style.REPLICATE:
            return True
        module = self.res.modules[path]
        kind = type(module).__name__
        where = self.rel(path, got.producer)
        src = got.producer
        if got.dtensor:
            hint = (
                "; make it vocab_parallel"
                if isinstance(module, nn.Linear) and module.out_features == self.vocab
                else f"; shard {where} too, or hand it a local tensor (local=true)"
            )
            self.fail(
                src or path,
                f"hands {where} ({kind}, not sharded) a DTensor ({got.layout}); a plain module "
                f"cannot mix one with its own parameters{hint}",
                src,
                path,
            )
        elif got.layout == "partial":
            self.fail(
                src or path,
                f"output=partial hands on partial sums that nothing reduces: {where} ({kind}, not "
                "sharded) reads them as the full activation; drop output=partial (the default "
                "reduces them), "
                "or hand them on as a DTensor (local=false) to a sharded layer",
                src,
                path,
            )
        elif (
            got.layout == "shard(-1)"
            and src
            and self.style(src) == Style.COLWISE
            and is_norm(module)
        ):
            self.fail(
                src,
                f"colwise output ({got.describe()}) reaches {where} ({kind}, not sharded, so it "
                "reads "
                "full activations only): a norm over each head takes `replicate(reduce_grad=true)` "
                "(its gradient "
                "is summed over the ranks), a norm over all features `sharded_norm`",
                src,
                path,
            )
        elif got.layout == "shard(-1)" and src and self.style(src) == Style.COLWISE:
            self.fail(
                src,
                f"colwise output ({got.describe()}) reaches {where} ({kind}, not sharded), which "
                "needs "
                f"the full features: no rowwise consumes it; make {where} rowwise, or give the "
                "colwise layer "
                "output=replicate",
                src,
                path,
            )
        else:
            self.fail(
                src or path,
                f"hands {where} ({kind}, not sharded) {got.describe()}, but it needs the full "
                "activation",
                src,
                path,
            )
        return False

    def step(self, path: str, got: Act) -> Act | None:
        """The activation after module `path` reads `got`; None after a reported problem."""
        m = self.layouts.get(path)
        module = self.res.modules[path]
        if m is None:
            if isinstance(module, nn.Embedding):
                return PLAIN  # reads token ids
            if isinstance(module, nn.Dropout):
                return got  # elementwise: any layout passes through
            return PLAIN if self._plain(path, got) else None
        if m.style == Style.VOCAB_PARALLEL and m.embedding:
            return Act(layout_text(m.output), not m.local, path)
        # normalises the colwise slice it reads, hands on the same slice
        if m.style == Style.SHARDED_NORM:
            return Act("shard(-1)", False, path) if self._expect(path, "shard(-1)", got) else None
        if m.style == Style.SEQUENCE_PARALLEL:  # a plain input is read as the full sequence
            return Act("shard(1)", True, path) if self._expect(path, "replicate", got) else None
        # replicate(reduce_grad=true) runs on whatever arrives (a per-head norm on local heads)
        if m.input is None:
            return got
        if not self._expect(path, layout_text(m.input), got):
            return None
        if m.style == Style.VOCAB_PARALLEL:
            return Act("shard(-1)", True, path)
        out = Act(layout_text(m.output), not m.local, path)
        parent = path.rpartition(".")[0]
        if (
            m.style == Style.COLWISE
            and out.dtensor
            and "." in path
            and attention_like(self.res.modules[parent])
        ):
            self.fail(
                path,
                f"colwise hands the attention's own code ({self.rel(parent, path)}) a DTensor, but "
                "its head reshapes, rotary embeddings and scaled_dot_product_attention run on local "
                "tensors; "
                "drop local=false",
                path,
            )
            return None
        return out

    # ---- the residual stream ------------------------------------------------------------------------

    def _covered(self, path: str) -> bool:
        """Under sequence parallelism a residual-stream norm or dropout must be sequence_parallel."""
        module = self.res.modules[path]
        if (
            not self.sp
            or not (is_norm(module) or isinstance(module, nn.Dropout))
            or self.style(path) is not None
        ):
            return True
        pattern = path
        for block in self.block_paths:
            if path.startswith(block + "."):
                head, _, _ = block.rpartition(".")
                pattern = f"{head}.*.{path[len(block) + 1 :]}"
        self.fail(
            path,
            "sequence parallelism covers only some norms and dropouts: this "
            f"{type(module).__name__} is "
            "not sequence_parallel, but once one is, the residual stream is sequence-sharded and "
            "every norm "
            f"and dropout on it must be too; add `{pattern}: sequence_parallel`",
        )
        return False

    def _residual(self) -> Act:
        return Act("shard(1)", True) if self.sp else PLAIN

    def _join(self, branch: str, got: Act) -> None:
        """A branch's result is added back to the residual stream: DTensor under sequence
        parallelism, else plain."""
        if (
            got.dtensor == self.sp
            and (self.sp or got.layout == Style.REPLICATE)
            and got.layout != "partial"
        ):
            return
        src = got.producer
        where = f"{branch}'s result reaches the residual stream as {got.describe()}"
        # even as a DTensor: left to the residual add's implicit redistribution,
        if got.layout == "partial":
            # it breaks DTensor's backward on some shapes (a one-token sequence shard)
            self.fail(
                src or branch,
                f"output=partial: {where}, sums that nothing in the plan reduces before "
                "they are added; drop output=partial (the default reduces them)",
                src,
            )
        elif self.sp and not got.dtensor:
            fix = (
                "drop local=true"
                if src
                else f"shard {branch} (sequence parallelism reaches every branch)"
            )
            self.fail(
                src or branch,
                f"{where}, but under sequence parallelism the residual stream is a "
                f"sequence-sharded DTensor: a DTensor and a local tensor cannot be added; {fix}",
                src,
            )
        elif got.dtensor:
            self.fail(
                src or branch,
                f"{where}, but without sequence parallelism the residual stream is a plain "
                "tensor: a DTensor and a local tensor cannot be added; drop local=false",
                src,
            )
        elif got.layout == "shard(-1)" and src and self.style(src) == Style.COLWISE:
            self.fail(
                src,
                f"colwise output unconsumed: {where}, with no rowwise to reduce it first; make the "
                "branch's next Linear rowwise, or give this one output=replicate",
                src,
            )
        else:
            self.fail(
                src or branch, f"{where}, but it must be the full activation as a plain tensor", src
            )

    def branch(self, block: str, leaves: list[str], start: Act) -> None:
        """Walk one branch of a block from the residual stream and add its result back."""
        leaves = _execution_order(leaves, self.style)
        sources = branch_flow(self.trace, leaves) if self.trace is not None else None
        if sources is None:
            sources = branch_sources(self.res.modules, leaves, (nn.Dropout,))
        # the forward (as it ran, else its source) says which output each leaf reads
        if sources is not None:
            got = meet_by_source(self, sources, start)
            if got is not None:
                self._join(leaves[0][len(block) + 1 :].split(".")[0], got)
            return
        got, sibling_input = start, None
        for path in leaves:
            if (
                self.style(path) == Style.COLWISE
                and sibling_input is not None
                and got.producer
                and got.producer.rpartition(".")[0] == path.rpartition(".")[0]
            ):
                # q/k/v, gate/up: colwise siblings read the same input and hand on alike
                before = got
                got = self.step(path, sibling_input)
                if got is None:
                    return
                if (got.layout, got.dtensor) != (before.layout, before.dtensor):
                    self.fail(
                        path,
                        f"colwise siblings hand on different layouts: {got.describe()} here, "
                        f"{before.describe()} from {self.rel(before.producer, path)}; give them the "
                        "same "
                        "output and local options",
                        path,
                    )
                    return
                continue
            # a sharded norm of q leaves k, v reading q's input
            if self.style(path) != Style.SHARDED_NORM:
                sibling_input = got if self.style(path) == Style.COLWISE else None
            got = self.step(path, got)
            if got is None:
                return
        name = leaves[0][len(block) + 1 :].split(".")[0]
        self._join(name, got)

    def walk(self, order: list[str]) -> None:
        """The top-level chain, entering every block with the residual stream."""
        stream, last_embedding, entered = PLAIN, None, False
        i = 0
        while i < len(order):
            path = order[i]
            block = next((a for a in ancestors(path) if a in self.block_set), None)
            if block is None:
                i += 1
                if not self._covered(path):
                    stream = Act("shard(1)", True, path)
                    continue
                got = self.step(path, stream)
                if got is None:
                    return
                if isinstance(self.res.modules[path], nn.Embedding) and last_embedding is not None:
                    if not self._combine(*last_embedding, path, got):
                        return
                last_embedding = (
                    (path, got) if isinstance(self.res.modules[path], nn.Embedding) else None
                )
                stream = got
                continue
            leaves = []
            while i < len(order) and order[i].startswith(block + "."):
                leaves.append(order[i])
                i += 1
            if not entered:
                entered = True
                if not self._enter(block, stream):
                    return
            stream = self._residual() if self.sp else stream
            self._block(block, leaves)
            last_embedding = None
        self._output(stream)

    def _combine(self, first_path: str, first: Act, second_path: str, second: Act) -> bool:
        """Consecutive top-level embeddings (token + position) are added: their layouts must agree."""
        if (first.dtensor, first.layout) == (second.dtensor, second.layout):
            return True
        (a_path, a), (b_path, b) = sorted(
            [(first_path, first), (second_path, second)], key=lambda pa: pa[0] not in self.layouts
        )
        fix = (
            "give it output=replicate, local=true and cut the sum into sequence shards with a "
            "sequence_parallel "
            "dropout or norm after it (plans/gpt2-sp.tp)"
            if self.sp
            else "hand on the full activation as a local tensor (the default)"
        )
        self.fail(
            a_path,
            f"its output ({a.describe()}) is added to {b_path}'s ({b.describe()}), and the two "
            f"cannot be combined; {fix}",
            a_path,
        )
        return False

    def _enter(self, block: str, stream: Act) -> bool:
        """The residual stream must reach the first block as every branch will hand it back."""
        if stream.dtensor == self.sp and (self.sp or stream.layout == Style.REPLICATE):
            return True
        src = stream.producer
        if self.sp:
            self.fail(
                src or block,
                f"the residual stream enters {block} as {stream.describe()}, but sequence "
                "parallelism needs it sequence-sharded from the first block on; make the embedding "
                "vocab_parallel (its output is then reduce-scattered into sequence shards), or a "
                "dropout or "
                "norm before the first block sequence_parallel",
                src,
            )
        else:
            self.fail(
                src or block,
                f"hands the residual stream {stream.describe()} as it enters {block}; without "
                "sequence parallelism it must be the full activation as a local tensor"
                + ("; drop local=false" if stream.dtensor else "; drop the output option"),
                src,
            )
        return False

    def _block(self, block: str, leaves: list[str]) -> None:
        stream = self._residual()
        groups: dict[str, list[str]] = {}
        for path in leaves:
            child = path[len(block) + 1 :].split(".")[0]
            groups.setdefault(child, []).append(path)
        # Linears held directly by the block (OPT's fc1, fc2): one branch together
        chain: list[str] = []
        for child, paths in groups.items():
            direct = paths == [f"{block}.{child}"]
            module = self.res.modules[paths[0]]
            if direct and not (is_norm(module) or isinstance(module, nn.Dropout)):
                chain.append(paths[0])
                continue
            if chain:
                self.branch(block, chain, stream)
                chain = []
            if direct:  # a norm or dropout on the residual stream
                if self._covered(paths[0]):
                    self.step(paths[0], stream)
            else:
                self.branch(block, paths, stream)
        if chain:
            self.branch(block, chain, stream)

    def _output(self, stream: Act) -> None:
        src = stream.producer
        if (stream.layout, stream.dtensor) == ("replicate", False) or (
            stream.dtensor
            and src
            and self.style(src) == Style.VOCAB_PARALLEL
            and not self.layouts[src].embedding
        ):
            return
        self.fail(
            src or "the model",
            f"its output ({stream.describe()}) is the model's output, which nothing "
            "gathers; use vocab_parallel on the output projection (the loss then runs "
            "vocab-parallel), or "
            "output=replicate",
            src,
        )


def analyse(
    res: Resolution,
    sp: bool,
    layouts: Mapping[str, object],
    vocab: int | None,
    report: Report,
    trace: Trace | None = None,
) -> None:
    """Walk `res`'s model with the plan's module layouts (`dtp.layout.lower`'s) and report what
    cannot meet."""
    order: list[str] = []
    for path, module in res.modules.items():
        if not path or any(path.startswith(p + ".") for p in order[-1:]):
            continue  # inside a module already taken (a norm's own children)
        if path in layouts or _relevant(module):
            order.append(path)
    _Walk(res, layouts, sp, vocab, report, trace).walk(order)
