"""Hypothesis strategies drawing model structures for `dtp plan --auto`
(tests/fixtures/auto_models.py).

Every axis of a model family is drawn: fused ([q | k | v] or interleaved) or separate q/k/v;
multi-head, grouped-query and multi-query attention; head counts from the tensor or from attributes;
per-head q/k norms; SwiGLU, fused gate_up or GELU; sequential or parallel blocks; tied or untied
head. Head counts and widths sometimes divide tp and sometimes do not (2 heads at tp 4, 66 hidden
MLP features at tp 4, a vocabulary of 66), so the planner's refusals are drawn too.
"""

from __future__ import annotations

from fixtures.auto_models import HEADS_FROM, MLPS, QKV, Structure
from hypothesis import strategies as st


@st.composite
def structures(draw: st.DrawFn) -> Structure:
    """One model structure within the fixture's limits (hidden ≤ 64, ≤ 2 layers, vocabulary ≤ 128)."""
    n_head = draw(st.sampled_from([4, 2, 8]))
    # MHA, GQA, MQA
    n_kv_head = draw(st.sampled_from([d for d in (n_head, 2, 1) if n_head % d == 0]))
    return Structure(
        qkv=draw(st.sampled_from(QKV)),
        n_head=n_head,
        n_kv_head=n_kv_head,
        head_dim=draw(st.sampled_from([8, 4])),  # 8 heads × 8 = 64, the widest the fixture allows
        heads_from=draw(st.sampled_from(HEADS_FROM)),
        qk_norm=draw(st.booleans()),
        mlp=draw(st.sampled_from(MLPS)),
        intermediate=draw(st.sampled_from([64, 48, 66])),
        parallel=draw(st.booleans()),
        tied=draw(st.booleans()),
        bias=draw(st.booleans()),
        n_layer=draw(st.sampled_from([2, 1])),
        vocab=draw(st.sampled_from([64, 128, 66])),
        seed=draw(st.integers(0, 3)),
    )


def cases() -> st.SearchStrategy[tuple[Structure, int]]:
    """A structure and the tp to plan it for: 2 mostly, 4 for about one in three."""
    return st.tuples(structures(), st.sampled_from([2, 2, 4]))
