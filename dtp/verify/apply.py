"""`dtp apply`: check the plan and the machine, start the ranks (or join torchrun's), enforce the timeout, report.

Not under torchrun, the ranks are started by `dtp.runtime.launcher.launch_local` (loopback rendezvous, timeout, one
paragraph for a failed rank, nothing left behind); under torchrun this process is one rank of the launched world.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from dtp import models
from dtp.checks.checker import check, render_warnings, sequence_shape_problem
from dtp.errors import RunError, UsageError
from dtp.lang.parse import load, resolve_plan
from dtp.layout.trace import TRACES
from dtp.runtime import preflight
from dtp.runtime.launcher import error_summary, launch_local, pick_device
from dtp.runtime.torchrun import torchrun_group, torchrun_world
from dtp.verify.probes import MAX_PROBE_SEQ
from dtp.verify.rank import RunConfig, run
from dtp.verify.report import ApplyReport


def _apply_rank(rank: int, world: int, cfg: RunConfig) -> ApplyReport | None:
    """One rank of `dtp apply` on an initialised process group; rank 0 returns the report."""
    return run(cfg)


def launch_apply(cfg: RunConfig) -> ApplyReport:
    """Start tp×dp local ranks, wait at most cfg.timeout seconds, and return rank 0's report."""
    try:
        return launch_local(_apply_rank, cfg.tp * cfg.dp, cfg, timeout=cfg.timeout, device=cfg.device,
                            prefix="dtp-apply-")[0]
    except RunError as err:
        raise RunError(str(err).replace("the run", "the sharded run", 1), err.rank, err.where, err.error) from None


def _torchrun_rank(cfg: RunConfig) -> ApplyReport | None:
    """This process as one rank of torchrun's world: torchrun's rendezvous settings stand."""
    with torchrun_group(cfg.device, cfg.timeout) as rank:
        try:
            return run(cfg)
        except Exception as err:  # noqa: BLE001 - one paragraph per failing rank, as for local runs
            e = error_summary(err, rank)
            raise RunError(f"the sharded run failed on rank {rank} in {e['where']}: {e['error']}", rank, e["where"],
                           e["error"]) from None


def absolute_model_spec(spec: str) -> str:
    """A YAML model path made absolute (a factory may change the working directory); other specs as given."""
    return str(Path(spec).absolute()) if spec.endswith((".yaml", ".yml")) and Path(spec).is_file() else spec


def _probe_length(meta, max_seq: int | None, seq: int, needs: Callable[[int], int | None]) -> int:
    """The long probes' length (dtp.verify.probes): --max-seq, else the model's stated maximum (at most
    MAX_PROBE_SEQ) halved until its estimate (`needs(n)` bytes; None: not estimated) fits in memory."""
    if max_seq is not None and max_seq < seq:
        raise UsageError(f"--max-seq {max_seq} is shorter than --seq {seq}: the steps already run {seq} tokens")
    length = max_seq or min(models.max_sequence(meta) or MAX_PROBE_SEQ, MAX_PROBE_SEQ)
    avail = preflight.available_bytes()
    while length > seq and avail is not None and (needs(length) or 0) > avail:
        if max_seq is not None:
            raise UsageError(f"--max-seq {max_seq}: the long probe needs about {needs(length) / 2**30:.1f} GiB of memory "
                             f"but {avail / 2**30:.1f} GiB is available; use a smaller --max-seq")
        length //= 2
    return max(length, seq)


def apply_command(*, plan: str, model: str, tp: int | None, dp: int, batch: int, seq: int, steps: int, seed: int,
                  lr: float, dtype: str, device: str, timeout: float, max_seq: int | None = None) -> ApplyReport | None:
    """`dtp apply`: check the plan and the machine (UsageError, exit 2, before any rank starts), run the ranks, and
    return rank 0's report (None on another torchrun rank). `plan` and `model` as the user wrote them."""

    # Every path is absolute before user code runs: a model factory may call os.chdir.
    plan_path = str(resolve_plan(plan).absolute())  # a file, or a shipped plan's name
    model_spec = absolute_model_spec(model)
    world = torchrun_world()  # None: not launched by torchrun (a stray variable is ignored, with a warning)
    torchrun = world is not None
    tp = tp or (world // dp if world else 2)
    if batch % dp:
        raise UsageError(f"--batch {batch} (the global batch) must divide by --dp {dp}")
    if torchrun and tp * dp != world:
        raise UsageError(f"--tp {tp} × --dp {dp} = {tp * dp} ranks, but torchrun started WORLD_SIZE={world}")
    device = pick_device(device, 1 if torchrun else tp * dp)
    if not torchrun:
        preflight.check_world(tp * dp, device)
        if device == "cuda" and tp * dp > preflight.cuda_device_count():
            raise UsageError(f"tp={tp} × dp={dp} needs {tp * dp} GPUs; this machine has "
                             f"{preflight.cuda_device_count()}. Use --device cpu, or torchrun across machines")

    parsed = load(plan)  # messages name the plan as the user wrote it; ranks get the absolute path
    cwd = os.getcwd()
    source = models.resolve(model_spec)
    meta = models.build(source, device="meta")
    if source.pretrained is not None:  # a missing or mis-shaped tensor: exit 2 before any rank starts
        models.check_weights(meta, source.pretrained)
    os.chdir(cwd)  # ranks start where the user started dtp, whatever the factory did
    vocab = models.vocab_size(meta)
    if vocab is None:
        raise UsageError(f"model {model} has no nn.Embedding and no config.vocab_size: dtp feeds it token "
                         "ids, so it must know the vocabulary size")
    forward = TRACES.calling(meta, model)  # how to call it for every position's logits, or exit 2
    checked = check(parsed, meta, tp, dp)  # exit 2 before any rank starts
    sys.stderr.write(render_warnings(checked))
    shape_problem = sequence_shape_problem(checked, tp, seq)
    if shape_problem:
        raise UsageError(shape_problem)
    elem = {"float32": 4, "bfloat16": 2, "float64": 8}[dtype]
    if not torchrun:
        preflight.check_memory(preflight.estimate(meta, tp, dp, batch, seq, elem, vocab), device)
    max_seq = _probe_length(meta, max_seq, seq, lambda n: None if torchrun or device != "cpu" else
                            preflight.estimate(meta, tp, dp, 1, n, elem, vocab).total)
    cfg = RunConfig(plan=plan_path, model=model_spec, tp=tp, dp=dp, batch=batch, seq=seq, steps=steps, seed=seed,
                    dtype=dtype, device=device, timeout=timeout, lr=lr, max_seq=max_seq, forward=forward)

    report = _torchrun_rank(cfg) if torchrun else launch_apply(cfg)
    if report is None:
        return None
    return replace(report, plan={**report.plan, "file": plan}, model=model)  # as the user wrote them (config: what ran)
