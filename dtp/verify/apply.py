"""`dtp apply`: the job's pre-flight (dtp.runtime.preflight.prepare, plus the memory this run
needs), its ranks (dtp.runtime.preflight.launch: local, or this process as its rank of torchrun's
world), rank 0's report.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from dtp import models
from dtp.errors import RunError, UsageError
from dtp.runtime import preflight
from dtp.runtime.preflight import Prepared, launch, prepare
from dtp.runtime.torchrun import torchrun_world
from dtp.verify.probes import MAX_PROBE_SEQ
from dtp.verify.rank import RunConfig, run
from dtp.verify.report import ApplyReport

ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float64": 8}


def _apply_rank(rank: int, world: int, cfg: RunConfig) -> ApplyReport | None:
    """One rank of `dtp apply` on an initialised process group; rank 0 returns the report."""
    return run(cfg)


def absolute_model_spec(spec: str) -> str:
    """A YAML model path made absolute (a factory may change the working directory); other specs as
    given."""
    return (
        str(Path(spec).absolute())
        if spec.endswith((".yaml", ".yml")) and Path(spec).is_file()
        else spec
    )


def _probe_length(meta, max_seq: int | None, seq: int, needs: Callable[[int], int | None]) -> int:
    """The long probes' length (dtp.verify.probes): --max-seq, else the model's stated maximum (at
    most MAX_PROBE_SEQ) halved until its estimate (`needs(n)` bytes; None: not estimated) fits in
    memory."""
    if max_seq is not None and max_seq < seq:
        raise UsageError(
            f"--max-seq {max_seq} is shorter than --seq {seq}: the steps already run {seq} tokens"
        )
    length = max_seq or min(models.max_sequence(meta) or MAX_PROBE_SEQ, MAX_PROBE_SEQ)
    avail = preflight.available_bytes()
    while length > seq and avail is not None and (needs(length) or 0) > avail:
        if max_seq is not None:
            raise UsageError(
                f"--max-seq {max_seq}: the long probe needs about {needs(length) / 2**30:.1f} GiB "
                "of memory "
                f"but {avail / 2**30:.1f} GiB is available; use a smaller --max-seq"
            )
        length //= 2
    return max(length, seq)


def prepare_apply(cfg: RunConfig) -> Prepared:
    """The pre-flight of one apply run: `prepare`, then the memory the ranks and the references need
    on this machine and the probes' length; its job is `cfg` as the ranks run it (device, forward
    and max_seq decided)."""
    prepared = prepare(cfg)
    job, meta, vocab, local = prepared.job, prepared.meta, prepared.vocab, prepared.world is None
    elem = ELEMENT_BYTES[job.dtype]
    if local:
        preflight.check_memory(
            preflight.estimate(meta, job.tp, job.dp, job.batch, job.seq, elem, vocab), job.device
        )
    max_seq = _probe_length(
        meta,
        job.max_seq,
        job.seq,
        lambda n: (
            None
            if not local or job.device != "cpu"
            else preflight.estimate(meta, job.tp, job.dp, 1, n, elem, vocab).total
        ),
    )
    return replace(prepared, job=replace(job, max_seq=max_seq, forward=prepared.forward))


def run_prepared(prepared: Prepared) -> ApplyReport | None:
    """Run a prepared apply job on its ranks: rank 0's report (None on another torchrun rank)."""
    try:
        results = launch(prepared, _apply_rank, prefix="dtp-apply-")
    except RunError as err:  # the sharded run, as against the references
        raise RunError(
            str(err).replace("the run", "the sharded run", 1), err.rank, err.where, err.error
        ) from None
    return results[0] if prepared.reports else None


def launch_apply(cfg: RunConfig) -> ApplyReport | None:
    """Check `cfg` (UsageError or PlanError, exit 2, before any rank starts), run its ranks and
    return rank 0's report (None on another torchrun rank)."""
    return run_prepared(prepare_apply(cfg))


def apply_command(
    *,
    plan: str,
    model: str,
    tp: int | None,
    dp: int,
    batch: int,
    seq: int,
    steps: int,
    seed: int,
    lr: float,
    dtype: str,
    device: str,
    timeout: float,
    max_seq: int | None = None,
) -> ApplyReport | None:
    """`dtp apply`: `launch_apply` on the job the flags describe, `tp` None meaning torchrun's
    WORLD_SIZE / dp (2 not under torchrun); the report names the plan and model as the user wrote
    them."""
    # None: not launched by torchrun (a stray variable is ignored, with a warning)
    world = torchrun_world()
    # a world that dp does not divide: the pre-flight says so
    tp = tp or (max(world // dp, 1) if world else 2)
    cfg = RunConfig(
        plan=plan,
        model=absolute_model_spec(model),
        tp=tp,
        dp=dp,
        batch=batch,
        seq=seq,
        steps=steps,
        seed=seed,
        lr=lr,
        dtype=dtype,
        device=device,
        timeout=timeout,
        max_seq=max_seq,
    )
    report = launch_apply(cfg)
    if report is None:
        return None
    return replace(report, model=model)  # as the user wrote it (config: what ran)
