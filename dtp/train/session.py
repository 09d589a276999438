"""What `dtp train PLAN MODEL` does: check, prepare the data, start the ranks (or join torchrun's),
summarise.

Exit status: 0 trained (and, with --compare-tp, the curves agree); 1 a rank failed, the loss
diverged, the tp ranks' replicas diverged or the curves differ; 2 a plan, data, flag or resource
error (before any rank starts); 130 interrupted (Ctrl-C), 143 terminated (SIGTERM), as every dtp
command.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from dataclasses import replace
from pathlib import Path

from dtp.checkpoint.lock import held
from dtp.cost.explain import human_bytes
from dtp.cost.param_bytes import param_bytes_per_rank
from dtp.errors import RunError, Terminated, UsageError
from dtp.layout.styles.spec import NotModeled
from dtp.runtime.data_parallel import ddp_available
from dtp.runtime.keyed_init import init_rule
from dtp.runtime.preflight import Prepared, launch, prepare
from dtp.runtime.threads import cores
from dtp.simulate import profile
from dtp.train import data, replica_checks, resume, verify
from dtp.train.budget import check_budget, check_init_memory, check_train_memory
from dtp.train.loop import TrainConfig, train
from dtp.train.parity import FLOORS, compare, markdown
from dtp.train.plot import loss_png
from dtp.train.predict import predict, table
from dtp.train.resume import resumed_line, saved_line


def _preflight(cfg: TrainConfig, max_rank_memory: int | None) -> Prepared:
    """The job's pre-flight (dtp.runtime.preflight.prepare), then what only training refuses before
    any rank starts: recomputation under dropout, FSDP2's 0-D parameters, what the keyed init cannot
    draw, the memory."""
    # a pretrained directory's --init model: each rank reads its own slices
    # (dtp.runtime.pretrained), no rank 0 copy
    prepared = prepare(cfg, weights=cfg.init == "model")
    job, model, checked = prepared.job, prepared.meta, prepared.checked
    whole_on_rank0 = job.init == "model" and prepared.source.pretrained is None
    if job.recompute != "none" and any(
        getattr(m, "p", 0) > 0 for m in model.modules() if type(m).__name__ == "Dropout"
    ):
        raise UsageError(
            f"--recompute {job.recompute} with dropout > 0 would redraw different masks when the "
            "forward is recomputed; use a model with dropout 0"
        )
    if job.dp > 1:  # FSDP2 refuses these mid-start-up on every rank: one paragraph here instead
        scalars = [n for n, p in model.named_parameters() if p.dim() == 0]
        if scalars:
            raise UsageError(
                f"--dp {job.dp} shards parameters with FSDP2, which cannot shard 0-D parameters "
                f"({', '.join(scalars[:3])}{', …' if len(scalars) > 3 else ''}); train with --dp 1, "
                "or "
                "make them 1-D tensors of one element"
            )
    if job.init == "keyed":  # a parameter the keyed initialisation cannot draw: exit 2 here
        for path, module in model.named_modules():
            for pname, param in module.named_parameters(recurse=False):
                init_rule(model, module, pname, f"{path}.{pname}".lstrip("."), param.dim())
    if whole_on_rank0:  # rank 0 builds the whole model before scattering it
        check_init_memory(checked, model, job.tp, job.dp, job.device)
    # every rank on this host (a GPU run is bounded by its GPUs)
    if prepared.world is None and job.device == "cpu":
        check_train_memory(
            checked,
            model,
            job.tp,
            job.dp,
            batch=job.micro_batch * job.dp,
            seq=job.seq,
            vocab=prepared.vocab,
            shards=job.state_shards,
            act_elem=4 if job.dtype == "float32" else 2,
            init_model=whole_on_rank0,
        )
    if job.dp_mode == "ddp" and job.dp > 1 and not ddp_available():
        raise UsageError(
            "--dp-mode ddp needs torch's replicate over FSDP2 parameter groups "
            "(torch.distributed._composable.replicate_with_fsdp), which this torch lacks; use "
            "--dp-mode fsdp or a newer torch"
        )
    if job.profile is not None:  # a bad profile is exit 2 here, not after training
        profile.load(job.profile)
    if max_rank_memory is not None:
        check_budget(checked, model, job.tp, job.state_shards, max_rank_memory)
    return prepared


def run_training(prepared: Prepared, corpus: data.Corpus) -> list[dict]:
    """Train once (local ranks or this torchrun rank); every rank's summary, rank 0 first."""
    cfg = prepared.job
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    Path(cfg.out, "metrics.jsonl").write_text("")  # a fresh run starts a fresh log
    # The checkpoint's lock for a local run: a second run saving there is refused before its ranks
    # start, and what a killed save left (CHECKPOINT.tmp-*) is removed on the way out, after Ctrl-C
    # or SIGTERM too.
    with held(cfg.checkpoint) if prepared.world is None else contextlib.nullcontext():
        results = launch(prepared, train, corpus, prefix="dtp-train-", threads=cfg.threads)
    return _replicas_held(results)


def _replicas_held(results: list[dict]) -> list[dict]:
    """`results`, or a RunError (exit 1) when the tp ranks' replicated tensors diverged (every rank
    stopped; with dp > 1 the first rank whose tp group diverged says what differs) or the sharded
    model left its float64 replay (dtp.train.verify)."""
    record = next((r["replicas"] for r in results if r["replicas"]["divergences"]), None)
    if record is not None:
        raise RunError(replica_checks.message(record, record["steps"][-1]))
    masks = next((r["dropout"] for r in results if r["dropout"] and r["dropout"]["problems"]), None)
    if masks is not None:
        first, more = masks["problems"][:3], len(masks["problems"]) - 3
        raise RunError(
            "dropout breaks its tensors' placement on the first step (dtp.verify.dropout): "
            + "; ".join(first)
            + (f"; and {more} more site(s)" if more > 0 else "")
        )
    if not results[0]["verify"]["ok"]:
        raise RunError(verify.message(results[0]["verify"]["checks"][-1]))
    return results


def summary(prepared: Prepared, corpus: data.Corpus, results: list[dict]) -> dict:
    """The final summary (also written as OUT/summary.json)."""
    first, cfg = results[0], prepared.job
    shards = cfg.state_shards  # DDP: every dp rank holds its tp rank's whole shard
    table = param_bytes_per_rank(prepared.checked, prepared.meta, cfg.tp, shards)
    table *= cfg.dp // shards
    return {
        "config": cfg.to_json(),
        "corpus": {
            "name": corpus.name,
            "tokens": corpus.n_tokens,
            "train_tokens": corpus.n_train,
            "tokenizer": corpus.tokenizer,
            "unigram_entropy": data.unigram_entropy(corpus),
        },
        "val_loss": first["val_loss"],
        "perplexity": math.exp(min(first["val_loss"], 700)),
        "final_loss": first["losses"][-1],
        "tokens_per_s": first["tokens_per_s"],
        "step_time_ms": first["step_time_ms"],
        "comm_share": first["comm_share"],
        "param_bytes_per_rank": [r["param_bytes"] for r in results],
        "param_bytes_table": table,
        "peak_memory_bytes": [r["peak_memory_bytes"] for r in results],
        "peak_memory_kind": first["peak_memory_kind"],
        "collectives": first["collectives"],
        "analytic_collectives": first["analytic_collectives"],
        "losses": first["losses"],
        "val_losses": first["val_losses"],
        "start_step": first["start_step"],
        "resumed": first["resumed"],
        "checkpoints": first["saves"],
        "replicas": first["replicas"],
        "verify": first["verify"],
        "dropout": first["dropout"],
        "threads_per_rank": first["threads"],
        "ranks": len(results),
        "cores": cores(),
        "plain": first["plain"],
        "loss_scale": first["loss_scale"],
        "predicted": _predicted(prepared),
        "measured": first["measured"],
    }


def _predicted(prepared: Prepared) -> dict:
    """`dtp simulate`'s figures for rank 0 of this run's layout (on --profile, if given); what the
    simulator cannot model (a model without a transformer's config, a plan beyond its schedule) is
    said, not guessed: the run itself is not wrong for it."""
    job = prepared.job
    on = profile.load(job.profile) if job.profile else None
    try:
        return predict(job, prepared.meta, on, rank=0, checked=prepared.checked)
    except (UsageError, NotModeled) as err:
        return {"not_modeled": str(err)[:300]}


def render(s: dict) -> str:
    """The human summary."""
    cfg, corpus = s["config"], s["corpus"]
    coll, analytic = s["collectives"], s["analytic_collectives"]
    agree = (
        "not modeled"
        if "not_modeled" in analytic
        else (
            "matches the analytic schedule"
            if all(coll[k] == analytic[k] for k in ("by_op", "forward", "backward"))
            else f"DIFFERS from the analytic schedule ({analytic['total']})"
        )
    )
    ops = ", ".join(f"{n} {op}" for op, n in sorted(coll["by_op"].items())) or "none"
    return "\n".join(
        [
            f"dtp train: {cfg['model']} under {cfg['plan']}, {_layout(cfg)}, "
            f"{cfg['steps']} steps of {cfg['batch']} × {cfg['seq']} tokens{_micro(cfg)}",
            f"  data: {corpus['name']} ({corpus['tokens']} tokens, {corpus['tokenizer']}; unigram "
            "entropy "
            f"{corpus['unigram_entropy']:.3f} nats)",
            *resumed_line(s),
            f"  validation loss {s['val_loss']:.4f} nats/token (perplexity {s['perplexity']:.2f}); "
            "final training "
            f"loss {s['final_loss']:.4f}",
            f"  speed: {s['tokens_per_s']:.0f} tokens/s, {s['step_time_ms']:.1f} ms/step (median), "
            f"communication {s['comm_share']:.0%} of the step; {_threads(s)}",
            f"  collectives per step: {coll['total']} ({ops}); {agree}",
            *_scale_line(s["loss_scale"], cfg["steps"] - s["start_step"]),
            *table(s["predicted"], s["measured"]),
            f"  parameters per rank: {', '.join(human_bytes(b) for b in s['param_bytes_per_rank'])} "
            ""
            f"(placement table: {', '.join(human_bytes(b) for b in s['param_bytes_table'])})",
            f"  peak memory ({s['peak_memory_kind']}) per rank: "
            f"{', '.join(human_bytes(b) for b in s['peak_memory_bytes'])}",
            *replica_checks.line(s["replicas"]),
            *verify.line(s["verify"]),
            *_dropout_line(s["dropout"]),
            *saved_line(s),
        ]
    )


def _layout(cfg: dict) -> str:
    """'tp=2 dp=2 (DDP), float16, recompute selective'."""
    dp = f"dp={cfg['dp']}" + (f" ({cfg['dp_mode'].upper()})" if cfg["dp"] > 1 else "")
    recompute = f", recompute {cfg['recompute']}" if cfg["recompute"] != "none" else ""
    return f"tp={cfg['tp']} {dp}, {cfg['dtype']}{recompute}"


def _micro(cfg: dict) -> str:
    """' (4 micro-batches of 2 per dp rank)' under gradient accumulation, else nothing."""
    n = cfg["batch"] // cfg["dp"] // cfg["micro_batch"]
    return f" ({n} micro-batches of {cfg['micro_batch']} per dp rank)" if n > 1 else ""


def _scale_line(record: dict | None, steps: int) -> list[str]:
    """float16's loss scaler: its scale at the end and the steps it skipped."""
    if record is None:
        return []
    return [
        f"  loss scale: {record['final']:.0f} at the end; {record['skipped_steps']} of {steps} "
        "steps skipped for a non-finite gradient"
    ]


def _dropout_line(record: dict | None) -> list[str]:
    """What the first step's mask probe compared (dtp.verify.dropout), and the model's own
    generators."""
    if record is None:
        return []
    held = record["generators"]
    return [
        f"  dropout: {record['sites']} mask site(s) on the first step masked as their tensors are "
        "placed (alike where replicated, per rank where sharded)"
        + (f"; generators the model holds: {', '.join(held)}" if held else "")
    ]


def _threads(s: dict) -> str:
    """'2 ranks × 1 thread (2 cores)', and 'plain PyTorch' for a one-rank model left without
    DTensor."""
    ranks, threads = s["ranks"], s["threads_per_rank"]
    text = (
        f"{ranks} rank{'s' if ranks > 1 else ''} × {threads} thread{'s' if threads > 1 else ''} "
        f"({s['cores']} core{'s' if s['cores'] > 1 else ''})"
    )
    return text + (", plain PyTorch (no DTensor)" if s.get("plain") else "")


def train_command(
    cfg: TrainConfig,
    *,
    data_path: str | None = None,
    tokenizer: str = "bytes",
    compare_tp: list[int] | None = None,
    max_rank_memory: int | None = None,
    json_path: str | None = None,
) -> int:
    """`dtp train PLAN MODEL ...`: pre-flight, train `cfg` (or the same job at each tp of
    `compare_tp`), summarise; the exit status. `data_path`: --data (None: the standard library's
    source); `json_path`: the summary's copy."""
    if compare_tp and cfg.dtype not in FLOORS:
        raise UsageError(
            f"--compare-tp has measured noise floors for {' and '.join(FLOORS)} only, not "
            f"{cfg.dtype}: compare in one of those"
        )
    if compare_tp and (cfg.checkpoint or cfg.resume):
        raise UsageError(
            "--compare-tp trains from scratch at each tp; it takes no --checkpoint or --resume"
        )
    cfg = resume.validate(cfg)
    continuing = resume.continuing_line(cfg)
    if continuing and os.environ.get("RANK", "0") == "0":  # under torchrun: rank 0 says it
        print(continuing, flush=True)
    out = Path(cfg.out)
    jobs = (
        [replace(cfg, tp=tp, out=str(out / f"tp{tp}")) for tp in compare_tp]
        if compare_tp
        else [cfg]
    )
    # every tp: exit 2 before any rank starts
    prepared = [_preflight(job, max_rank_memory) for job in jobs]
    corpus = data.prepare(
        data_path, out / "cache", tokenizer=tokenizer, model_vocab=prepared[0].vocab
    )
    data.check_fits(corpus, cfg.batch, cfg.seq)
    if compare_tp:
        return _compare(prepared, corpus, out)
    one = prepared[0]
    try:
        results = run_training(one, corpus)
    # SIGTERM arrives as Terminated, a KeyboardInterrupt: 143, as apply
    except KeyboardInterrupt as stop:
        print(
            f"{_stopped(stop)}; the metrics so far are in {out / 'metrics.jsonl'}", file=sys.stderr
        )
        return 143 if isinstance(stop, Terminated) else 130
    except RunError as err:
        raise RunError(f"{err} (the metrics so far are in {out / 'metrics.jsonl'})") from None
    if not one.reports:
        return 0  # under torchrun rank 0 reports
    s = summary(one, corpus, results)
    _write(out / "summary.json", s)
    if json_path:
        _write(Path(json_path), s)
    print(render(s))
    job = one.job
    note = loss_png(
        out / "loss.png",
        {f"tp={job.tp}": (s["losses"], s["val_losses"])},
        f"{job.model}, {job.plan}, tp={job.tp} dp={job.dp}, {job.dtype}",
    )
    print(
        f"  metrics: {out / 'metrics.jsonl'} · summary: {out / 'summary.json'}"
        + (f" · {note}" if note else f" · loss curve: {out / 'loss.png'}")
    )
    return 0


def _compare(prepared: list[Prepared], corpus: data.Corpus, out: Path) -> int:
    """Train at each tp from the same initial weights on the same batches; overlay and tabulate."""
    runs: dict[int, dict] = {}
    for one in prepared:
        tp, cfg = one.job.tp, one.job
        print(f"training at tp={tp} …", file=sys.stderr, flush=True)
        try:
            runs[tp] = summary(one, corpus, run_training(one, corpus))
            _write(Path(cfg.out, "summary.json"), runs[tp])
        except KeyboardInterrupt as stop:
            print(
                f"{_stopped(stop)}; the metrics so far are in {out}/tp*/metrics.jsonl",
                file=sys.stderr,
            )
            return 143 if isinstance(stop, Terminated) else 130
        # a failed tp fails the comparison (a plan whose replicas drift cannot pass)
        except RunError as err:
            raise RunError(
                f"at tp={tp}: {err} (the metrics so far are in {Path(cfg.out, 'metrics.jsonl')})"
            ) from None
        print(render(runs[tp]), flush=True)
    job = prepared[0].job
    try:
        twin = _twin(prepared[0], corpus, out)
    except KeyboardInterrupt as stop:
        print(f"{_stopped(stop)} in the noise twin", file=sys.stderr)
        return 143 if isinstance(stop, Terminated) else 130
    verdict = compare(runs, job.dtype, twin)  # the band the twin measures: dtp/train/parity.py
    table = markdown(verdict.rows, job.tp)
    (out / "compare.md").write_text(table + "\n", encoding="utf-8")
    _write(
        out / "compare.json",
        {
            **verdict.as_json(),
            "dtype": job.dtype,
            "unigram_entropy": next(iter(runs.values()))["corpus"]["unigram_entropy"],
        },
    )
    note = loss_png(
        out / "compare.png",
        {f"tp={tp}": (r["losses"], r["val_losses"]) for tp, r in runs.items()},
        f"{job.model}, {job.plan}, {job.dtype}: same init, same batches",
    )
    print("\n" + table)
    print(
        f"\nconvergence parity: {'OK' if verdict.ok else 'FAILED'} — worst per-step |Δloss| / loss "
        f"{verdict.worst_rel_dloss:.2e}, {verdict.worst_margin:.2f} of the band at its step "
        f"({job.dtype} band: {verdict.band.describe()})"
    )
    for problem in verdict.problems:
        print(f"  {problem}")
    print(
        f"table: {out / 'compare.md'}"
        + (f" · {note}" if note else f" · curves: {out / 'compare.png'}")
    )
    return 0 if verdict.ok else 1


def _twin(first: Prepared, corpus: data.Corpus, out: Path) -> dict:
    """The first tp's run again with every batch's rows reversed: the same sums in another order,
    so its curve differs from the first tp's by this run's own rounding noise."""
    job = replace(first.job, twin=True, verify_every=0, out=str(out / "twin"))
    print(
        f"training the noise twin (tp={job.tp}, every batch's rows reversed) …",
        file=sys.stderr,
        flush=True,
    )
    twin = replace(first, job=job)
    result = summary(twin, corpus, run_training(twin, corpus))
    _write(Path(job.out, "summary.json"), result)
    return result


def _stopped(stop: KeyboardInterrupt) -> str:
    return "terminated" if isinstance(stop, Terminated) else "interrupted"


def _write(path: Path, data: dict) -> None:
    try:
        path.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    except OSError as err:
        raise UsageError(f"cannot write {path}: {err.strerror}") from None
