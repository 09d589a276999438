"""Checkpoints in `dtp train`: check a resume before any rank starts, load it into a rank's Trainer,
save every N steps and at the end.

A checkpoint is dtp.checkpoint.dcp's (DCP, reshards across tp/dp) with `Trainer.train_state()` as
its `extra`: the step and the RNG states are all a resume needs, since batches and the learning rate
derive from the step.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.fsdp import FSDPModule

from dtp import models
from dtp.checkpoint.dcp import (
    check_plan_matches,
    load_checkpoint,
    model_shape,
    raise_interrupt,
    save_checkpoint,
)
from dtp.checkpoint.files import MARKER, CheckpointError, NoSpaceError, read_meta, some
from dtp.checkpoint.lock import refuse_if_held
from dtp.checkpoint.optim_state import unpack
from dtp.checkpoint.untrusted import SafeReader
from dtp.cost.explain import human_bytes
from dtp.errors import UsageError
from dtp.train.plain_view import as_dtensors

MAX_EXTRA_BYTES = 16 << 20  # train_state() is a few KiB (the RNG state); a larger claim is not ours


def _resolved(path: str, flag: str) -> Path:
    """`path` with its symlinks resolved; a loop is a usage error, not a traceback."""
    try:
        return Path(path).resolve()
    except (RuntimeError, OSError):  # Python 3.11 raises RuntimeError on a symlink loop
        raise UsageError(f"{flag} {path} is a symlink loop (or cannot be resolved)") from None


def saved_state(directory: Path) -> tuple[dict, dict]:
    """(dtp.json, rank 0's train_state) of a complete checkpoint, read in this process without
    ranks."""
    meta = read_meta(directory)
    size = meta.get("objects", {}).get("extra/rank0")
    if not isinstance(size, int) or not 0 < size <= MAX_EXTRA_BYTES:
        raise CheckpointError(
            f"checkpoint {directory} holds no training state (extra/rank0); it was not "
            "written by `dtp train`"
        )
    state = {"extra/rank0": torch.empty(size, dtype=torch.uint8)}
    # refuses what is not data (code in .metadata, byte entries) with its reason
    reader = SafeReader(directory)
    try:
        # "assuming the intent is to load in a single process": it is
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - CheckpointException is a BaseException
        raise_interrupt(err)
        raise CheckpointError(
            f"checkpoint {directory} is corrupt or unreadable: {type(err).__name__}"
        ) from None
    extra = unpack(state["extra/rank0"], f"{directory}: extra/rank0")
    if (
        not isinstance(extra, dict)
        or not isinstance(extra.get("step"), int)
        or "rng_cpu" not in extra
    ):
        raise CheckpointError(
            f"checkpoint {directory} holds no `dtp train` state (step, RNG); it was not "
            "written by `dtp train`"
        )
    return meta, extra


def _check_model(meta: dict, spec: str, directory: Path) -> None:
    """Refuse, before any rank, a checkpoint whose model tensors are not this model's (names, full
    shapes)."""
    model = models.build(models.resolve(spec), device="meta")
    persistent = model.state_dict(keep_vars=True).keys()
    here = {
        f"model/{n}": tuple(t.shape)
        for n, t in [*model.named_parameters(), *model.named_buffers()]
        if n in persistent
    }
    saved = {
        k: model_shape(k, tuple(v["shape"]), meta.get("packed", {}), meta.get("packed_dims", {}))
        for k, v in meta["tensors"].items()
        if k.startswith("model/")
    }
    problems = (
        [f"it has no {some(sorted(set(here) - set(saved)))}"] if set(here) - set(saved) else []
    )
    if set(saved) - set(here):
        problems.append(f"{spec} has no {some(sorted(set(saved) - set(here)))}")
    problems += [
        f"{k} is {list(saved[k])} in the checkpoint, {list(here[k])} here"
        for k in sorted(set(here) & set(saved))
        if saved[k] != here[k]
    ]
    if problems:
        raise CheckpointError(
            f"checkpoint {directory} does not fit {spec}: " + "; ".join(problems[:4])
        )


def validate(cfg):
    """The checkpoint to resume from, before any rank starts (exit 2, one paragraph): it holds this
    model, this plan (or `cfg.convert`) and a step before cfg.steps. Returns `cfg` (a TrainConfig)
    with its checkpoint directories absolute: ranks may run elsewhere."""
    if cfg.checkpoint:
        cfg = replace(cfg, checkpoint=str(_resolved(cfg.checkpoint, "--checkpoint")))
        refuse_if_held(Path(cfg.checkpoint))  # another run saving there: said first
        # a run restarted with its own --checkpoint DIR continues from it (torchrun's
        # --max-restarts, a pre-empted job run again): the steps since the last save are lost
        held = _holds_something(Path(cfg.checkpoint))
        if held and cfg.fresh and not Path(cfg.checkpoint, MARKER).is_file():
            # a save replaces only a checkpoint: refused now, not after the training
            raise UsageError(
                f"--checkpoint {cfg.checkpoint} holds files and is not a dtp checkpoint; dtp never "
                "replaces it: name another directory"
            )
        if held and not cfg.resume and not cfg.fresh:
            cfg = replace(cfg, resume=cfg.checkpoint, automatic=True)
    if not cfg.resume:
        return cfg
    hint = ", or --fresh to start over" if cfg.automatic else ""
    directory = _resolved(cfg.resume, "--resume")
    try:
        meta, extra = saved_state(directory)
        try:
            check_plan_matches(meta, cfg.plan_ir(), directory, cfg.convert)
        except UsageError as err:
            raise type(err)(f"{err} (`dtp train --convert`)") from None
        _check_model(meta, cfg.model, directory)
    except UsageError as err:
        if not cfg.automatic:
            raise
        raise type(err)(
            f"this run would continue from its --checkpoint {directory}, but {err}; --fresh "
            "starts over"
        ) from None
    if extra["step"] >= cfg.steps:
        raise UsageError(
            f"checkpoint {directory} is at step {extra['step']}, not before --steps "
            f"{cfg.steps}: nothing left to train (raise --steps{hint})"
        )
    saved = extra.get("config") or {}
    return replace(
        cfg,
        resume=str(directory),
        resumed_from={
            "step": extra["step"],
            "tp": saved.get("tp"),
            "dp": saved.get("dp"),
            "dp_mode": saved.get("dp_mode", "fsdp"),
        },
    )


def _holds_something(directory: Path) -> bool:
    """Whether --checkpoint DIR exists with anything in it (a checkpoint to continue, or something
    that is not one: refused)."""
    try:
        return directory.is_dir() and any(directory.iterdir())
    except OSError:
        return False


def continuing_line(cfg) -> str | None:
    """The report's first line for a run that continues from its own --checkpoint (none else)."""
    if not cfg.automatic:
        return None
    was = cfg.resumed_from
    return (
        f"dtp train: continuing from {cfg.checkpoint} at step {was['step']} (saved at "
        f"{_layout(was['tp'], was['dp'], was['dp_mode'])}; now "
        f"{_layout(cfg.tp, cfg.dp, cfg.dp_mode)}); --fresh starts over"
    )


def _layout(tp, dp, mode) -> str:
    return f"tp {tp} × dp {dp}" + (
        f" ({str(mode).upper()})" if isinstance(dp, int) and dp > 1 else ""
    )


def _stored(trainer):
    """The model as the checkpoint stores it: a plain tp-1 model's packed tensors as DTensors
    (dtp.train.plain_view), under the plan the run was checked and built with."""
    if not trainer.applied.plain:
        return contextlib.nullcontext()
    return as_dtensors(trainer.model, trainer.optimizer, trainer.mesh, trainer.checked.plan)


def restore(trainer, cfg) -> dict:
    """Load cfg.resume into the rank's sharded model and optimizer, set its step and RNG; the load's
    stats."""
    stats: dict = {}
    text = cfg.plan_text  # the text the run was checked and built with
    with _stored(trainer):
        extra = load_checkpoint(
            cfg.resume,
            trainer.model,
            trainer.optimizer,
            mesh=trainer.mesh,
            plan_text=text,
            convert=cfg.convert,
            stats=stats,
        )
    trainer.step = extra["step"]
    torch.set_rng_state(extra["rng_cpu"])
    if trainer.device.type == "cuda" and extra.get("rng_cuda") is not None:
        torch.cuda.set_rng_state(extra["rng_cuda"])
    if trainer.fp16 and extra.get("loss_scale"):  # a float32 or bfloat16 checkpoint has none
        trainer.scaler.load_state_dict(extra["loss_scale"])
    return {
        "path": cfg.resume,
        "step": trainer.step,
        "bytes": stats["bytes"],
        "seconds": stats["seconds"],
    }


def due(cfg, step: int) -> bool:
    """Whether to save after `step` (1-based): every --save-every steps, and at the end."""
    return bool(cfg.checkpoint) and (
        (cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps
    )


# where a failed save says the run failed ("the run failed on rank R in WHERE: …")
_SAVING = "the checkpoint save"


def save(trainer, cfg) -> dict:
    """Save the rank's model, optimizer and train_state to cfg.checkpoint (every rank calls it);
    stats. A full disk fails the run: every rank raises the same one-line NoSpaceError, which says
    what the checkpoint left in cfg.checkpoint holds (docs/train.md, "When the disk is full")."""
    # FSDP2 keeps the root's parameters gathered after a forward with no backward (an evaluation),
    # and the model then names those instead of the sharded ones the optimizer holds: shard them
    # back first.
    for module in trainer.model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    text = cfg.plan_text  # the text the run was checked and built with
    try:
        with _stored(trainer):
            stats = save_checkpoint(
                cfg.checkpoint,
                trainer.model,
                trainer.optimizer,
                mesh=trainer.mesh,
                plan_text=text,
                extra=trainer.train_state(),
            )
    except NoSpaceError as err:
        told = err.told(
            what=f"saving step {trainer.step} to {cfg.checkpoint}",
            after=_left_behind(Path(cfg.checkpoint)),
        )
        told.__dtp_where__ = _SAVING  # the run's failure names the save, not the start-up
        raise told from None
    except Exception as err:
        err.__dtp_where__ = getattr(err, "__dtp_where__", None) or _SAVING
        raise
    return {"step": trainer.step, "bytes": stats["bytes"], "seconds": stats["seconds"]}


def _left_behind(directory: Path) -> str:
    """What a failed save left in `directory`, for its message: the step of the checkpoint there."""
    try:
        _, extra = saved_state(directory)
    except CheckpointError:
        return f"there was no checkpoint in {directory} to resume from"
    return f"the checkpoint of step {extra['step']} in {directory} is unchanged and resumes"


def resumed_line(s: dict) -> list[str]:
    """The summary's line for a resumed run (none otherwise)."""
    r = s.get("resumed")
    if not r:
        return []
    return [
        f"  resumed from {r['path']} at step {r['step']} "
        f"(loaded {human_bytes(r['bytes'])} in {r['seconds']:.2f} s)"
    ]


def saved_line(s: dict) -> list[str]:
    """The summary's line for the checkpoints saved (none otherwise)."""
    saves = s.get("checkpoints")
    if not saves:
        return []
    seconds = sorted(c["seconds"] for c in saves)
    return [
        f"  checkpoint: {s['config']['checkpoint']} saved after step "
        f"{', '.join(str(c['step']) for c in saves)} "
        f"({human_bytes(saves[-1]['bytes'])}, {seconds[len(seconds) // 2]:.2f} s per save, median)"
    ]
