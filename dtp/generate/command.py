"""`dtp generate`: the job's pre-flight (dtp.runtime.preflight.prepare, then the prompts against
the model's length and vocabulary), its ranks, rank 0's report.
"""

from __future__ import annotations

from dataclasses import replace

from dtp import models
from dtp.errors import UsageError
from dtp.generate.prompts import Tokens, parse_ids
from dtp.generate.rank import GenerateConfig, Sampling, generate
from dtp.runtime.preflight import launch, prepare


def _ids_of(value: object) -> tuple[int, ...]:
    """An id or a list of ids from a config, as a tuple of non-negative ints."""
    values = value if isinstance(value, (list, tuple)) else [value]
    return tuple(v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0)


def special_ids(meta) -> tuple[tuple[int, ...], int]:
    """(the end-of-sequence ids, the pad id) as `generate` reads them: the generation config's,
    else the model config's; the pad id defaults to the first end id, else 0."""
    found = {}
    for holder in (getattr(meta, "config", None), getattr(meta, "generation_config", None)):
        for key in ("eos_token_id", "pad_token_id"):
            ids = _ids_of(getattr(holder, key, None))
            if ids:
                found[key] = ids
    eos = found.get("eos_token_id", ())
    pad = found.get("pad_token_id", eos[:1] or (0,))[0]
    return eos, pad


def generate_command(
    *,
    plan: str,
    model: str,
    tp: int,
    prompts: list[str] | None,
    prompt_ids: str | None,
    max_new_tokens: int,
    dtype: str,
    device: str,
    seed: int,
    timeout: float,
    sampling: Sampling | None = None,
) -> dict | None:
    """Check everything, decode on tp ranks (greedily, or drawing as `sampling` says), return rank
    0's report (None on another torchrun rank)."""
    source = models.resolve(model)
    meta = models.build(source, device="meta")
    vocab = models.vocab_size(meta)
    tokens = Tokens(source.pretrained, vocab)
    ids = parse_ids(prompt_ids, vocab) if prompt_ids is not None else tokens.encode(prompts or [])
    longest = max(len(p) for p in ids) + max_new_tokens
    limit = models.max_sequence(meta)
    if limit is not None and longest > limit:
        raise UsageError(
            f"the longest prompt ({longest - max_new_tokens} tokens) + --max-new-tokens "
            f"{max_new_tokens} = {longest} is beyond the model's {limit} positions"
        )
    eos, pad = special_ids(meta)
    job = GenerateConfig(
        plan=plan,
        model=model,
        tp=tp,
        batch=len(ids),
        seq=max(len(p) for p in ids),
        seed=seed,
        dtype=dtype,
        device=device,
        timeout=timeout,
        prompts=tuple(tuple(p) for p in ids),
        max_new_tokens=max_new_tokens,
        eos=eos,
        pad=pad,
        sampling=sampling,
    )
    prepared = prepare(job)
    prepared = replace(prepared, job=replace(prepared.job, forward=prepared.forward))
    results = launch(prepared, generate, prefix="dtp-generate-")
    if not prepared.reports:
        return None
    report = results[0]
    report.update(
        plan=plan,
        model=model,
        tp=tp,
        dtype=dtype,
        prompts=[list(p) for p in ids],
        sampling=sampling.to_json() if sampling else None,
        tokenizer=tokens.name,
        texts=[tokens.decode(t) for t in report["tokens"]]
        if tokens.tokenizer is not False
        else None,
    )
    return report


def render(r: dict) -> str:
    """The human report."""
    lines = [
        f"dtp generate: {r['model']} under {r['plan']}, tp={r['tp']}, {r['dtype']}, "
        f"{len(r['prompts'])} prompt(s), {len(r['tokens'][0])} new token(s)",
        f"  {_decoding(r['sampling'])}",
    ]
    for i, row in enumerate(r["tokens"]):
        text = f"  {r['texts'][i]!r}" if r.get("texts") else ""
        lines.append(f"  prompt {i}: {' '.join(map(str, row))}{text}")
    per_rank = ", ".join(_kib(b) for b in r["kv_cache_bytes_per_rank"])
    whole = r["kv_cache_bytes_unsharded"]
    lines.append(
        f"  KV cache per rank: {per_rank}" + (f" (unsharded {_kib(whole)})" if whole else "")
        if r["decoded_with_cache"]
        else f"  no KV cache: {r['no_cache_reason']}"
    )
    coll = r["collectives_per_token"]
    ops = ", ".join(f"{n} {op}" for op, n in sorted(coll.items())) or "none"
    if r["ms_per_token"] is not None:
        lines.append(
            f"  prefill {r['prefill_ms']:.1f} ms · {r['ms_per_token']:.2f} ms per token "
            f"(median) · {r['tokens_per_s']:.0f} tokens/s · collectives per token: "
            f"{r['collectives_per_token_total']} ({ops})"
        )
        lines.append(
            f"  weights per rank: {', '.join(_size(b) for b in r['weight_bytes_per_rank'])} · "
            f"{r['memory_gb_per_s']:.2f} GB/s on rank 0 (its weights and KV cache over the "
            "median time per token)"
        )
    lines.append(_verdict(r))
    return "\n".join(lines)


def _decoding(s: dict | None) -> str:
    if s is None:
        return "greedy"
    filters = "".join(
        f", {name} {s[key]}" for name, key in (("top-k", "top_k"), ("top-p", "top_p")) if s[key]
    )
    return (
        f"sampling: temperature {s['temperature']:g}{filters}, sample seed {s['seed']} "
        "(Gumbel-max; every rank and the unsharded model draw the same noise)"
    )


def _verdict(r: dict) -> str:
    if not r["ranks_agree"]:
        return (
            f"  token-exact: FAILED — rank {r['first_disagreeing_rank']} decoded other tokens "
            "than rank 0"
        )
    if r["ok"]:
        ties = f"; {len(r['ties'])} tie(s) within rounding" if r["ties"] else ""
        return (
            "  token-exact: OK — every step's token is the unsharded model's, logits within "
            f"{r['parity']['logits']['margin']:.2g} of the bound{ties}"
        )
    d = r["first_difference"]
    if d is not None:
        sampled = r["sampling"] is not None
        apart = (
            f"its top-k/top-p leaves {d['token']} out"
            if d["truth_gap"] == float("inf")
            else f"its {'perturbed ' if sampled else ''}logits of the two {d['truth_gap']:.3g} "
            f"apart, beyond the step's bound {d['bound']:.3g}"
        )
        verb = ("sampled", "with the same noise samples") if sampled else ("chose", "chooses")
        return (
            f"  token-exact: FAILED — at step {d['step']} prompt {d['prompt']} the sharded model "
            f"{verb[0]} {d['token']} where the unsharded one {verb[1]} {d['truth_token']} "
            f"({apart})"
        )
    q = r["parity"]["logits"]
    what = "; ".join(q["problems"]) or (
        f"{q['worst']}: {q['max_rel']:.2e} relative, {q['margin']:.1f}× the bound"
    )
    step = r["first_failing_step"]
    where = "prefill" if step == 1 else f"step {step} (decode step {step - 1})"
    return (
        f"  token-exact: FAILED — from {where} the logits leave the unsharded model's "
        f"(step 1 is the prefill's last position); worst {what}"
    )


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"


def _size(n: int) -> str:
    """`n` bytes in KiB, MiB or GiB, whichever keeps the number below 1024."""
    for unit in ("KiB", "MiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.2f} GiB"
