"""Checkpoints in `dtp train`: check a resume before any rank starts, load it into a rank's Trainer, save
every N steps and at the end.

A checkpoint is dtp.checkpoint.dcp's (DCP, reshards across tp/dp) with `Trainer.train_state()` as its `extra`:
the step and the RNG states are all a resume needs, since batches and the learning rate derive from the step.
"""
from __future__ import annotations

import argparse
import contextlib
import warnings
from pathlib import Path

import torch

from dtp.errors import UsageError

MAX_EXTRA_BYTES = 16 << 20  # train_state() is a few KiB (the RNG state); a larger claim is not ours


def _plan_text(plan: str) -> str:
    try:
        return Path(plan).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"cannot read plan {plan}: {err}") from None


def _resolved(path: str, flag: str) -> Path:
    """`path` with its symlinks resolved; a loop is a usage error, not a traceback."""
    try:
        return Path(path).resolve()
    except (RuntimeError, OSError):  # Python 3.11 raises RuntimeError on a symlink loop
        raise UsageError(f"{flag} {path} is a symlink loop (or cannot be resolved)") from None


def saved_state(directory: Path) -> tuple[dict, dict]:
    """(dtp.json, rank 0's train_state) of a complete checkpoint, read in this process without ranks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from dtp.checkpoint.files import CheckpointError, read_meta
    from dtp.checkpoint.optim_state import unpack
    from dtp.checkpoint.untrusted import SafeReader

    meta = read_meta(directory)
    size = meta.get("objects", {}).get("extra/rank0")
    if not isinstance(size, int) or not 0 < size <= MAX_EXTRA_BYTES:
        raise CheckpointError(f"checkpoint {directory} holds no training state (extra/rank0); it was not "
                              "written by `dtp train`")
    state = {"extra/rank0": torch.empty(size, dtype=torch.uint8)}
    reader = SafeReader(directory)  # refuses what is not data (code in .metadata, byte entries) with its reason
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - CheckpointException is a BaseException
        raise CheckpointError(f"checkpoint {directory} is corrupt or unreadable: {type(err).__name__}") from None
    extra = unpack(state["extra/rank0"], f"{directory}: extra/rank0")
    if not isinstance(extra, dict) or not isinstance(extra.get("step"), int) or "rng_cpu" not in extra:
        raise CheckpointError(f"checkpoint {directory} holds no `dtp train` state (step, RNG); it was not "
                              "written by `dtp train`")
    return meta, extra


def _check_model(meta: dict, spec: str, directory: Path) -> None:
    """Refuse, before any rank, a checkpoint whose model tensors are not this model's (names, full shapes)."""
    from dtp import models
    from dtp.checkpoint.dcp import model_shape
    from dtp.checkpoint.files import CheckpointError, some

    model = models.build(models.resolve(spec), device="meta")
    persistent = model.state_dict(keep_vars=True).keys()
    here = {f"model/{n}": tuple(t.shape) for n, t in [*model.named_parameters(), *model.named_buffers()]
            if n in persistent}
    saved = {k: model_shape(k, tuple(v["shape"]), meta.get("packed", {}), meta.get("packed_dims", {}))
             for k, v in meta["tensors"].items() if k.startswith("model/")}
    problems = [f"it has no {some(sorted(set(here) - set(saved)))}"] if set(here) - set(saved) else []
    if set(saved) - set(here):
        problems.append(f"{spec} has no {some(sorted(set(saved) - set(here)))}")
    problems += [f"{k} is {list(saved[k])} in the checkpoint, {list(here[k])} here"
                 for k in sorted(set(here) & set(saved)) if saved[k] != here[k]]
    if problems:
        raise CheckpointError(f"checkpoint {directory} does not fit {spec}: " + "; ".join(problems[:4]))


def validate(args: argparse.Namespace) -> None:
    """Checkpoint flags, and the checkpoint to resume from, before any rank starts (exit 2 with one paragraph).
    Makes the directories absolute (ranks may run elsewhere) and records the resumed step in args."""
    from dtp.checkpoint.dcp import check_plan_matches

    if args.save_every and not args.checkpoint:
        raise UsageError("--save-every needs --checkpoint DIR (where to save)")
    if args.convert and not args.resume:
        raise UsageError("--convert applies to --resume DIR only")
    if args.compare_tp and (args.checkpoint or args.resume):
        raise UsageError("--compare-tp trains from scratch at each tp; it takes no --checkpoint or --resume")
    args.checkpoint = str(_resolved(args.checkpoint, "--checkpoint")) if args.checkpoint else None
    args.resume_step = 0
    if not args.resume:
        return
    directory = _resolved(args.resume, "--resume")
    args.resume = str(directory)
    meta, extra = saved_state(directory)
    try:
        check_plan_matches(meta, _plan_text(args.plan), directory, args.convert)
    except UsageError as err:
        raise type(err)(f"{err} (`dtp train --convert`)") from None
    _check_model(meta, args.model, directory)
    args.resume_step = extra["step"]
    if args.resume_step >= args.steps:
        raise UsageError(f"checkpoint {directory} is at step {args.resume_step}, not before --steps "
                         f"{args.steps}: nothing left to train (raise --steps)")


def _stored(trainer, plan_text: str):
    """The model as the checkpoint stores it: a plain tp-1 model's packed tensors as DTensors (dtp.train.plain_view)."""
    if not trainer.applied.plain:
        return contextlib.nullcontext()
    from dtp.train.plain_view import as_dtensors

    return as_dtensors(trainer.model, trainer.optimizer, trainer.mesh, plan_text)


def restore(trainer, cfg) -> dict:
    """Load cfg.resume into the rank's sharded model and optimizer, set its step and RNG; the load's stats."""
    from dtp.checkpoint.dcp import load_checkpoint

    stats: dict = {}
    text = _plan_text(cfg.plan)
    with _stored(trainer, text):
        extra = load_checkpoint(cfg.resume, trainer.model, trainer.optimizer, mesh=trainer.mesh, plan_text=text,
                                convert=cfg.convert, stats=stats)
    trainer.step = extra["step"]
    torch.set_rng_state(extra["rng_cpu"])
    if trainer.device.type == "cuda" and extra.get("rng_cuda") is not None:
        torch.cuda.set_rng_state(extra["rng_cuda"])
    return {"path": cfg.resume, "step": trainer.step, "bytes": stats["bytes"], "seconds": stats["seconds"]}


def due(cfg, step: int) -> bool:
    """Whether to save after `step` (1-based): every --save-every steps, and at the end."""
    return bool(cfg.checkpoint) and ((cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps)


def save(trainer, cfg) -> dict:
    """Save the rank's model, optimizer and train_state to cfg.checkpoint (every rank calls it); stats."""
    from torch.distributed.fsdp import FSDPModule

    from dtp.checkpoint.dcp import save_checkpoint

    # FSDP2 keeps the root's parameters gathered after a forward with no backward (an evaluation), and the
    # model then names those instead of the sharded ones the optimizer holds: shard them back first.
    for module in trainer.model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    text = _plan_text(cfg.plan)
    with _stored(trainer, text):
        stats = save_checkpoint(cfg.checkpoint, trainer.model, trainer.optimizer, mesh=trainer.mesh,
                                plan_text=text, extra=trainer.train_state())
    return {"step": trainer.step, "bytes": stats["bytes"], "seconds": stats["seconds"]}


def resumed_line(s: dict) -> list[str]:
    """The summary's line for a resumed run (none otherwise)."""
    r = s.get("resumed")
    if not r:
        return []
    from dtp.cost.explain import human_bytes

    return [f"  resumed from {r['path']} at step {r['step']} "
            f"(loaded {human_bytes(r['bytes'])} in {r['seconds']:.2f} s)"]


def saved_line(s: dict) -> list[str]:
    """The summary's line for the checkpoints saved (none otherwise)."""
    saves = s.get("checkpoints")
    if not saves:
        return []
    from dtp.cost.explain import human_bytes

    seconds = sorted(c["seconds"] for c in saves)
    return [f"  checkpoint: {s['config']['checkpoint']} saved after step {', '.join(str(c['step']) for c in saves)} "
            f"({human_bytes(saves[-1]['bytes'])}, {seconds[len(seconds) // 2]:.2f} s per save, median)"]
