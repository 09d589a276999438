"""What every rank of `dtp generate` does: build the sharded model, prefill the prompts, decode one
token per step; rank 0 decodes the same tokens through the unsharded model beside it and compares.

The tokens are the sharded model's greedy choices. Rank 0's unsharded copies — the float64 truth
and, for a lower dtype, one in the run's dtype (dtp.verify.parity's rule) — read the same tokens
(teacher forcing: a difference at one step cannot hide the next), each with its own cache. At every
step the sharded logits are compared with the truth's by the parity rule, and the chosen token with
the truth's: a different token is a failure unless the truth's own top two logits lie within the
step's bound (a tie the dtype's rounding may break either way; the report names it). Finished rows
(the end-of-sequence id) continue with the pad id, as `transformers`' `generate` does, and
decoding stops when every row has finished.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dtp import models
from dtp.errors import UsageError
from dtp.generate.prompts import left_padded
from dtp.lang.parse import parse
from dtp.models.calling import PLAIN, Forward
from dtp.models.decoding import Decoder, cache_reason, cache_tensors
from dtp.runtime.build import build_sharded
from dtp.runtime.comm import CommCounter
from dtp.runtime.job import Job, positive
from dtp.runtime.mesh import make_mesh, sync
from dtp.runtime.preflight import trusted
from dtp.verify.parity import ParityCheck, rule_bound
from dtp.verify.rank import DTYPES
from dtp.verify.reference import float64_default, full_value, own_rng, references

MAX_NEW_TOKENS = 4096


@dataclass(frozen=True, kw_only=True)
class GenerateConfig(Job):
    """`dtp generate`'s job: the plan, model and tp (Job; batch and seq are the prompts'), the
    prompts' ids and how many tokens to add."""

    prompts: tuple[tuple[int, ...], ...] = ()
    max_new_tokens: int = 16
    forward: Forward = PLAIN
    eos: tuple[int, ...] = ()  # ids that end a row
    pad: int = 0  # the id a row is padded with, before and after it ends

    def __post_init__(self) -> None:
        super().__post_init__()
        positive("--max-new-tokens", self.max_new_tokens)
        if self.max_new_tokens > MAX_NEW_TOKENS:
            raise UsageError(f"--max-new-tokens {self.max_new_tokens} is above {MAX_NEW_TOKENS}")


def _device(cfg: GenerateConfig) -> torch.device:
    if cfg.device != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _top2_gap(logits: torch.Tensor) -> torch.Tensor:
    """Each row's largest logit minus its second largest."""
    top = logits.double().topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


class Comparison:
    """Rank 0: the unsharded copies decoding the sharded model's tokens, and what they found."""

    def __init__(self, refs: list, decoder: Decoder, dtype: torch.dtype):
        self.refs, self.decoder = refs, decoder
        self.parity = ParityCheck(dtype)
        self.states: list = []
        self.first_difference: dict | None = None
        self.ties: list[dict] = []
        self.matches_unsharded = True
        self.first_bad_step: int | None = None  # the first step whose logits fail the rule

    def start(self, ids: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
        """Prefill every copy; their last logits."""
        outs = []
        for ref in self.refs:
            with torch.no_grad(), own_rng(ids.device), float64_default(ref.dtype):
                logits, state = self.decoder.prefill(ref.model, ids, mask)
            self.states.append(state)
            outs.append(logits)
        return outs

    def step(self, token: torch.Tensor) -> list[torch.Tensor]:
        """One token through every copy; their next logits."""
        outs = []
        for ref, state in zip(self.refs, self.states):
            with torch.no_grad(), own_rng(token.device), float64_default(ref.dtype):
                outs.append(self.decoder.step(ref.model, state, token))
        return outs

    def judge(self, step: int, got: torch.Tensor, outs: list[torch.Tensor], live: torch.Tensor):
        """Step `step`'s sharded logits (B, V) against the copies', for the rows still decoding."""
        truth, lowp = outs[0][live], (outs[1][live] if len(outs) > 1 else None)
        mine = got[live]
        self.parity.compare("logits", f"logits (step {step})", mine, truth, lowp)
        if not self.parity.ok and self.first_bad_step is None:
            self.first_bad_step = step
        chosen, best = mine.argmax(-1), truth.argmax(-1)
        unsharded = best if lowp is None else lowp.argmax(-1)  # the same-dtype run's choices
        self.matches_unsharded &= torch.equal(unsharded, chosen)
        rows = live.nonzero().flatten().tolist()
        bound = rule_bound(truth, lowp, self.parity.dtype)
        for i, row in enumerate(rows):
            if chosen[i] == best[i]:
                continue
            gap = _top2_gap(truth[i : i + 1]).item()
            seen = {
                "step": step,
                "prompt": row,
                "token": int(chosen[i]),
                "truth_token": int(best[i]),
                "truth_gap": gap,
                "bound": bound,
            }
            if gap <= bound:
                self.ties.append(seen)
            elif self.first_difference is None:
                self.first_difference = seen

    @property
    def ok(self) -> bool:
        """Every step's logits within the rule and every token the truth's (or a tie)."""
        return self.parity.ok and self.first_difference is None


def generate(rank: int, world: int, cfg: GenerateConfig) -> dict | None:
    """Decode on an initialised process group; rank 0 returns the report's fields."""
    device = _device(cfg)
    dtype = DTYPES[cfg.dtype]
    mesh = make_mesh(cfg.tp, 1, cfg.device)
    source = models.resolve(cfg.model)
    meta = models.build(source, device="meta", dtype=dtype)
    checked = trusted(parse(cfg.plan_text, cfg.plan), meta, cfg.tp)
    with own_rng(device):
        torch.manual_seed(cfg.seed)
        full = models.build(source, device="cpu", dtype=dtype).to(device) if rank == 0 else None
        refs = references(full.eval(), dtype, 0.0, cfg.forward) if rank == 0 else []
        applied = build_sharded(
            checked,
            source,
            mesh,
            seed=cfg.seed,
            device=device,
            dtype=dtype,
            full=full,
            from_rank0=True,
            plain=True,
        )
    del full
    model = applied.model.eval()
    decoder = Decoder.of(meta, cfg.forward)
    ids, mask = left_padded([list(p) for p in cfg.prompts], cfg.pad)
    ids, mask = ids.to(device), mask.to(device)
    compare = Comparison(refs, decoder, dtype) if rank == 0 else None
    counter = CommCounter()
    live = torch.ones(ids.shape[0], dtype=torch.bool, device=device)
    new: list[torch.Tensor] = []
    times: list[float] = []
    with torch.no_grad():
        decoder.prefill(model, ids, mask)  # a warm-up, not timed: first calls allocate and load
        sync(device)
        t0 = time.perf_counter()
        logits, state = decoder.prefill(model, ids, mask)
        logits = full_value(logits)
        sync(device)
        prefill_s = time.perf_counter() - t0
        outs = compare.start(ids, mask) if compare else None
        for step in range(1, cfg.max_new_tokens + 1):
            if compare:
                compare.judge(step, logits, outs, live)
            token = logits.argmax(-1)
            token = torch.where(live, token, torch.full_like(token, cfg.pad))
            new.append(token)
            if cfg.eos:
                live = live & ~torch.isin(token, torch.tensor(cfg.eos, device=device))
            if step == cfg.max_new_tokens or not bool(live.any()):
                break
            sync(device)
            t1 = time.perf_counter()
            with counter if step == 1 else contextlib.nullcontext():
                logits = full_value(decoder.step(model, state, token))
            sync(device)
            times.append(time.perf_counter() - t1)
            outs = compare.step(token) if compare else None
    cache_bytes = sum(t.numel() * t.element_size() for t in cache_tensors(state.cache))
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, cache_bytes)
    if rank != 0:
        return None
    unsharded = refs[-1]
    ref_cache = sum(t.numel() * t.element_size() for t in cache_tensors(compare.states[-1].cache))
    median = sorted(times)[len(times) // 2] if times else None
    return {
        "tokens": torch.stack(new, dim=1).tolist(),
        "decoded_with_cache": decoder.cached,
        "no_cache_reason": cache_reason(meta),
        "kv_cache_bytes_per_rank": gathered,
        "kv_cache_bytes_unsharded": ref_cache if unsharded.dtype in (None, dtype) else None,
        "prefill_ms": prefill_s * 1e3,
        "ms_per_token": median * 1e3 if median is not None else None,
        "tokens_per_s": ids.shape[0] / median if median else None,
        "collectives_per_token": counter.get_comm_counts() if times else {},
        "collectives_per_token_total": counter.get_total_counts() if times else 0,
        "matches_unsharded": compare.matches_unsharded and compare.first_difference is None,
        "ok": compare.ok,
        "first_difference": compare.first_difference,
        "first_failing_step": compare.first_bad_step,
        "ties": compare.ties,
        "parity": compare.parity.to_json(),
    }
