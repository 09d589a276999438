"""What every rank of `dtp generate` does: build the sharded model, prefill the prompts, decode one
token per step; rank 0 decodes the same tokens through the unsharded model beside it and compares.

The tokens are the sharded model's greedy choices, or with `Sampling` its samples. Rank 0's
unsharded copies — the float64 truth and, for a lower dtype, one in the run's dtype
(dtp.verify.parity's rule) — read the same tokens (teacher forcing: a difference at one step cannot
hide the next), each with its own cache. At every step the sharded logits are compared with the
truth's by the parity rule, and the chosen token with the truth's: a different token is a failure
unless the truth's logits, with the sharded choice's raised by the step's bound, choose it too (a tie
the dtype's rounding may break either way; the report names it). Finished rows (the end-of-sequence
id) continue with the pad id, as `transformers`' `generate` does, and decoding stops when every row
has finished.

Every rank chooses the same token without a collective: the logits are gathered whole (the same
bytes on every rank) and a sample is a deterministic function of them and of noise drawn on the CPU
from (sample seed, step). A broadcast from rank 0 would add a collective's latency to every token
for what the end of the run checks once: the ranks' tokens are gathered with their cache sizes and
compared (`ranks_agree`); a rank that chose differently would also have fed its shard another token,
which the next step's logits show.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtp.errors import UsageError, shorten
from dtp.generate.prompts import left_padded
from dtp.models.calling import PLAIN, Forward
from dtp.models.decoding import Decoder, cache_reason, cache_tensors
from dtp.runtime.comm import CommCounter
from dtp.runtime.job import MAX_SEED, Job, positive
from dtp.runtime.mesh import make_mesh, sync
from dtp.verify.parity import ParityCheck, rule_bound
from dtp.verify.rank import DTYPES, build_beside_references
from dtp.verify.reference import float64_default, full_value, own_rng

MAX_NEW_TOKENS = 4096


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """`--sample`: multinomial sampling as transformers' `generate(do_sample=True)` does it — its
    logits processors in its order: temperature, then top-k, then top-p — drawn by the Gumbel-max
    trick: the token is argmax(scores + g), g standard Gumbel noise seeded by (seed, step), which
    samples softmax(scores). The noise is the same on every rank and for every reference, so two runs
    choose differently only where their logits differ. Computed in float64 on the CPU, wherever the
    model runs: CUDA's generator draws other numbers than the CPU's."""

    temperature: float = 1.0  # the logits are divided by it before the filters
    top_k: int | None = None  # keep the k largest (and any tied with the k-th); None: no filter
    top_p: float | None = None  # keep the fewest most probable tokens holding top_p of the mass
    seed: int = 0  # --sample-seed: the noise's, not the model's initialisation (--seed)

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < math.inf:
            raise UsageError(f"--temperature must be a finite number > 0, got {shorten(t)}")
        if self.top_k is not None:
            positive("--top-k", self.top_k)
        p = self.top_p
        if p is not None and (
            isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1
        ):  # nan fails both comparisons
            raise UsageError(f"--top-p must be a number in (0, 1], got {shorten(p)}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise UsageError(f"--sample-seed must be an integer, got {shorten(self.seed)}")
        if not 0 <= self.seed <= MAX_SEED:
            raise UsageError(
                f"--sample-seed must be between 0 and {MAX_SEED}, got {shorten(self.seed)}"
            )

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) logits → the scores transformers samples from, in float64 with -inf where
        filtered: TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper (min_tokens_to_keep
        1), as transformers 5 computes them."""
        s = logits.detach().to("cpu", torch.float64) / self.temperature
        if self.top_k is not None:
            kth = s.topk(min(self.top_k, s.shape[-1])).values[..., -1:]
            s = s.masked_fill(s < kth, -math.inf)
        if self.top_p is not None and self.top_p < 1.0:
            ordered, order = s.sort(descending=False)
            below = ordered.softmax(-1).cumsum(-1)  # the mass of each token and all less probable
            drop = below <= 1 - self.top_p
            drop[..., -1:] = False  # the most probable token always stays
            s = s.masked_fill(drop.scatter(-1, order, drop), -math.inf)
        return s

    def noise(self, step: int, shape: tuple[int, int]) -> torch.Tensor:
        """Step `step`'s standard Gumbel noise (B, V), float64 on the CPU: a function of (seed,
        step) alone, so every rank and every reference draws the same numbers, and a step's noise
        does not depend on how many steps came before."""
        # one 64-bit generator seed from the pair; the CPU generator (mt19937) takes 64 bits
        key = hashlib.blake2b(f"{self.seed}:{step}".encode(), digest_size=8).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(key, "little"))
        u = torch.rand(shape, generator=gen, dtype=torch.float64)
        return -(-u.clamp_min(torch.finfo(torch.float64).tiny).log()).log()

    def choose(self, logits: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """(B, V) logits and noise → each row's sample (B,), on the CPU."""
        return (self.scores(logits) + noise).argmax(-1)

    def gap(self, logits: torch.Tensor, noise: torch.Tensor, best: int, chosen: int) -> float:
        """How far `chosen`'s perturbed score lies below `best`'s under one row's (V,) logits, in
        logit units (× the temperature, so it compares with a bound on the logits); inf where the
        filters leave `chosen` out."""
        perturbed = self.scores(logits[None])[0] + noise
        return ((perturbed[best] - perturbed[chosen]) * self.temperature).item()

    def explains(self, logits: torch.Tensor, noise: torch.Tensor, chosen: int, bound: float):
        """Whether rounding of `bound` on one row's (V,) logits can give `chosen`: the logits with
        its raised by the bound (every difference with it moved by the bound in its favour, as for
        the greedy tie) choose it with the same noise. Exact for temperature and top-k; for top-p
        it stays on the strict side (the tokens below `chosen` could gain mass too)."""
        raised = logits.detach().to("cpu", torch.float64).clone()
        raised[chosen] += bound
        return int(self.choose(raised[None], noise[None])[0]) == chosen

    def to_json(self) -> dict:
        """The report's `sampling` section."""
        return {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "seed": self.seed,
        }


@dataclass(frozen=True, kw_only=True)
class GenerateConfig(Job):
    """`dtp generate`'s job: the plan, model and tp (Job; batch and seq are the prompts'), the
    prompts' ids and how many tokens to add."""

    prompts: tuple[tuple[int, ...], ...] = ()
    max_new_tokens: int = 16
    forward: Forward = PLAIN
    eos: tuple[int, ...] = ()  # ids that end a row
    pad: int = 0  # the id a row is padded with, before and after it ends
    sampling: Sampling | None = None  # None: greedy

    def __post_init__(self) -> None:
        super().__post_init__()
        positive("--max-new-tokens", self.max_new_tokens)
        if self.max_new_tokens > MAX_NEW_TOKENS:
            raise UsageError(f"--max-new-tokens {self.max_new_tokens} is above {MAX_NEW_TOKENS}")


def _device(cfg: GenerateConfig) -> torch.device:
    if cfg.device != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def choose(
    logits: torch.Tensor, sampling: Sampling | None, noise: torch.Tensor | None
) -> torch.Tensor:
    """Each row's next token (B,) on the logits' device: the greedy argmax, or `sampling`'s draw
    with the step's `noise`."""
    if sampling is None:
        return logits.argmax(-1)
    return sampling.choose(logits, noise).to(logits.device)


class Comparison:
    """Rank 0: the unsharded copies decoding the sharded model's tokens, and what they found."""

    def __init__(
        self, refs: list, decoder: Decoder, dtype: torch.dtype, sampling: Sampling | None = None
    ):
        self.refs, self.decoder, self.sampling = refs, decoder, sampling
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

    def judge(
        self,
        step: int,
        got: torch.Tensor,
        chosen: torch.Tensor,
        outs: list[torch.Tensor],
        live: torch.Tensor,
        noise: torch.Tensor | None = None,
    ):
        """Step `step`'s sharded logits (B, V) and the tokens chosen from them (B,) against the
        copies', for the rows still decoding; `noise` is the step's (B, V) Gumbel noise (None:
        greedy), the same the sharded run drew."""
        truth, lowp = outs[0][live], (outs[1][live] if len(outs) > 1 else None)
        self.parity.compare("logits", f"logits (step {step})", got[live], truth, lowp)
        if not self.parity.ok and self.first_bad_step is None:
            self.first_bad_step = step
        noise = noise[live.cpu()] if noise is not None else None
        chosen = chosen[live].cpu()
        best = choose(truth, self.sampling, noise).cpu()
        # the same-dtype run's choices, with the same noise
        unsharded = best if lowp is None else choose(lowp, self.sampling, noise).cpu()
        self.matches_unsharded &= torch.equal(unsharded, chosen)
        rows = live.nonzero().flatten().tolist()
        bound = rule_bound(truth, lowp, self.parity.dtype)
        for i, row in enumerate(rows):
            mine, theirs = int(chosen[i]), int(best[i])
            if mine == theirs:
                continue
            # a tie when the truth, with the sharded choice's logit raised by the bound, would
            # choose it too: greedily, when the truth's logits of the two lie within the bound
            if self.sampling is None:
                gap = (truth[i, theirs] - truth[i, mine]).double().item()
                tie = gap <= bound
            else:
                gap = self.sampling.gap(truth[i], noise[i], theirs, mine)
                tie = self.sampling.explains(truth[i], noise[i], mine, bound)
            seen = {
                "step": step,
                "prompt": row,
                "token": mine,
                "truth_token": theirs,
                "truth_gap": gap,
                "bound": bound,
            }
            if tie:
                self.ties.append(seen)
            elif self.first_difference is None:
                self.first_difference = seen

    @property
    def ok(self) -> bool:
        """Every step's logits within the rule and every token the truth's (or a tie)."""
        return self.parity.ok and self.first_difference is None


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes of the parameters and buffers this rank holds (its shards of DTensors; a tied
    parameter once)."""
    tensors = [*model.parameters(), *model.buffers()]
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


def generate(rank: int, world: int, cfg: GenerateConfig) -> dict | None:
    """Decode on an initialised process group; rank 0 returns the report's fields."""
    device = _device(cfg)
    dtype = DTYPES[cfg.dtype]
    mesh = make_mesh(cfg.tp, 1, cfg.device)
    plan = cfg.plan_ir()
    with own_rng(device):
        torch.manual_seed(cfg.seed)
        built = build_beside_references(
            cfg, plan, mesh, device, dtype, forward=cfg.forward, training=False
        )
    applied, meta, refs = built.applied, built.meta, built.refs
    model = applied.model.eval()
    decoder = Decoder.of(meta, cfg.forward, new_tokens=cfg.max_new_tokens)
    ids, mask = left_padded([list(p) for p in cfg.prompts], cfg.pad)
    ids, mask = ids.to(device), mask.to(device)
    compare = Comparison(refs, decoder, dtype, cfg.sampling) if rank == 0 else None
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
            noise = cfg.sampling.noise(step, tuple(logits.shape)) if cfg.sampling else None
            token = choose(logits, cfg.sampling, noise)
            if compare:
                compare.judge(step, logits, token, outs, live, noise)
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
    tokens = torch.stack(new, dim=1).tolist()
    # once per run, not per token: did every rank decode rank 0's tokens?
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (cache_bytes, tokens, weight_bytes(model)))
    if rank != 0:
        return None
    apart = next((r for r, (_, theirs, _) in enumerate(gathered) if theirs != tokens), None)
    unsharded = refs[-1]
    ref_cache = sum(t.numel() * t.element_size() for t in cache_tensors(compare.states[-1].cache))
    median = sorted(times)[len(times) // 2] if times else None
    return {
        "tokens": tokens,
        "decoded_with_cache": decoder.with_cache,
        "no_cache_reason": cache_reason(meta),
        "kv_cache_bytes_per_rank": [b for b, _, _ in gathered],
        "weight_bytes_per_rank": [w for _, _, w in gathered],
        # what a decode step reads at least, over its median time: the rank's weights and the
        # cache it holds at the end (a step reads its cache so far: an upper bound on that part)
        "memory_gb_per_s": (gathered[0][2] + gathered[0][0]) / median / 1e9 if median else None,
        "kv_cache_bytes_unsharded": ref_cache if unsharded.dtype in (None, dtype) else None,
        "prefill_ms": prefill_s * 1e3,
        "ms_per_token": median * 1e3 if median is not None else None,
        "tokens_per_s": ids.shape[0] / median if median else None,
        "collectives_per_token": counter.get_comm_counts() if times else {},
        "collectives_per_token_total": counter.get_total_counts() if times else 0,
        "matches_unsharded": compare.matches_unsharded and compare.first_difference is None,
        "ok": compare.ok and apart is None,
        "ranks_agree": apart is None,
        "first_disagreeing_rank": apart,
        "first_difference": compare.first_difference,
        "first_failing_step": compare.first_bad_step,
        "ties": compare.ties,
        "parity": compare.parity.to_json(),
    }
