"""What `dtp simulate` predicts for `dtp train`'s own layout, set beside what the run measured.

Both sides are dicts with these keys, per rank and per optimizer step (all its micro-batches):

| key | predicted | measured (dtp.train.activations) |
|---|---|---|
| tp_bytes, dp_bytes | bytes this rank sends in the tp / dp group's collectives under ring algorithms (dtp.cost.schedule.sent_bytes): the simulator's tensor-parallel collectives; FSDP2's or DDP's analytic schedule | `collective_bytes` of `GroupCounter`s around every micro-batch's forward and backward and the optimizer's gradient settling and step (not the clip: nothing prices it) |
| parameter_bytes | dtp.cost.param_bytes' table: float32 master weights, FSDP2's dim-0 shards padded | `state_bytes`, each storage once |
| gradient_bytes | the same table: float32 gradients | `state_bytes` |
| optimizer_bytes | AdamW's two float32 moments of the rank's unpadded shards | `state_bytes` (not torch's scalar `step`) |
| activation_bytes | one micro-batch's saved activations (dtp.simulate.memory.activation_bytes without the working set, with what dtp train's implementation adds: `activations`) | `ForwardMeter` over one micro-batch's forward and loss |
| step_ms | the simulator's iteration on the profile; None without one | the step time |

`predicted["profile"]` names the profile (None without one), `predicted["step_note"]` says why a
profile gave no step time (None otherwise). What the simulator's Run does not say
and dtp train does: autocast over float32 weights keeps the residual stream, embeddings, norms and
every parameter's gradient in float32; DTensor's sequence-parallel layers save their gathered
input; dtp's selective and per-op policies keep every collective's output (none runs again) and,
through torch's selective checkpointing, every output the policy saves; dtp's selective policy
keeps less than K22's selective term: of each block, its input and the products, nonlinearities
and LayerNorms (`_selective`).
"""

from __future__ import annotations

from dataclasses import replace

import torch.nn as nn

from dtp.checks.checker import Checked, check
from dtp.cost.fsdp import unit_bytes, units
from dtp.cost.param_bytes import param_bytes_per_rank
from dtp.cost.schedule import Collective, sent_bytes
from dtp.lang.parse import parse
from dtp.runtime.job import TRAIN_PRECISIONS, state_shards
from dtp.simulate import flops as fl
from dtp.simulate.kernels import ELEM
from dtp.simulate.memory import activation_bytes, params_per_rank
from dtp.simulate.model import Run, Workload, simulate, tp_collectives, workload
from dtp.simulate.prepare import shape_of

PRECISION = {dtype: name for name, dtype in TRAIN_PRECISIONS.items()}  # the simulator's names
MASTER_ELEM = 4  # dtp train keeps float32 parameters, gradients and AdamW moments
KEYS = (
    "tp_bytes",
    "dp_bytes",
    "parameter_bytes",
    "gradient_bytes",
    "optimizer_bytes",
    "activation_bytes",
    "step_ms",
)


def micro_batch(job) -> int:
    """Sequences per micro-batch per dp rank (None: the rank's whole share of the batch)."""
    return job.micro_batch or job.batch // job.dp


def run_of(job, profile=None) -> Run:
    """The simulator's Run for `job`: AdamW, FSDP2 or DDP (overlapped as the profile says), and the
    flash kernel (the fused SDPA the models call; on a CPU, the one `--calibrate` measures)."""
    return Run(
        job.tp,
        job.dp,
        micro_batch(job),
        job.batch,
        job.seq,
        PRECISION[job.dtype],
        job.recompute,
        "adam",
        getattr(profile, "dp_overlap", False),
        fsdp=job.dp_mode == "fsdp" and job.dp > 1,
        attention="flash",
    )


def predict(
    job, meta_model: nn.Module, profile=None, *, rank: int = 0, checked: Checked | None = None
) -> dict:
    """The predicted figures (KEYS, and "profile") for `rank` of `job` (duck-typed: plan,
    plan_text, model, tp, dp, batch, seq, micro_batch, recompute, dtype, dp_mode, and device:
    "cpu" when absent), `meta_model` the model on the meta device, `profile` a
    dtp.simulate.profile.Profile or None."""
    # the run's own checked plan where the caller has it (the parent checks a plan once)
    checked = checked or check(parse(job.plan_text, job.plan), meta_model, job.tp)
    precision = PRECISION[job.dtype]
    counted = fl.count(meta_model, job.seq, checked.resolution) if profile else None
    work = workload(
        checked,
        meta_model,
        job.tp,
        seq=job.seq,
        micro_batch=micro_batch(job),
        precision=precision,
        flops=counted,
        params_per_rank=params_per_rank(meta_model, checked.resolution, job.tp),
        shape=shape_of(meta_model),
    )
    run = run_of(job, profile)
    device = getattr(job, "device", "cpu")
    step_ms, step_note = _step(work, run, profile)
    return {
        "profile": getattr(profile, "name", None),
        "tp_bytes": tp_bytes(work, run, meta_model),
        "dp_bytes": dp_bytes(job, checked, meta_model),
        **state(job, checked, meta_model, rank),
        "activation_bytes": activations(work, run, norms_kept=_norms_kept(meta_model, device)),
        "step_ms": step_ms,
        "step_note": step_note,
    }


def _step(work: Workload, run: Run, profile) -> tuple[float | None, str | None]:
    """(predicted step milliseconds, why there is none): None without a profile, or with one that
    has no GEMM rate at the run's precision (a CPU calibration measures float32 only)."""
    if profile is None:
        return None, None
    if run.precision not in profile.peak_tflops:
        rates = ", ".join(profile.peak_tflops)
        return None, f"profile {profile.name} has no {run.precision} GEMM rate, only {rates}"
    return simulate(work, run, profile).iteration_s * 1e3, None


def _param_gradient(c: Collective) -> bool:
    """A reduction of a parameter's gradient (a sequence-parallel norm's, replicated packed rows):
    the gradient is a Partial DTensor, summed once per step where the optimizer settles it."""
    return c.reason.startswith("gradient of replicated") or c.reason.endswith("replicated parts")


def _float32_under_autocast(c: Collective, meta_model: nn.Module) -> bool:
    """Whether autocast leaves the tensor `c` moves in float32: autocast casts a matrix multiply's
    inputs, so its products and their gradients are in the training precision, while an embedding's
    output, a norm's output (gathered into sequence shards' whole before the cast), the gradients
    reaching them (f, the gather's reduce-scatter) and parameters' gradients stay float32."""
    reason = c.reason.removeprefix("recomputed forward: ")
    phase = "forward" if reason != c.reason else c.phase  # a recomputed one as in its forward
    module = meta_model.get_submodule(c.module) if c.module else meta_model
    return (
        isinstance(module, nn.Embedding)
        or _param_gradient(c)
        or (reason.endswith("gradient (f)") and "routing" not in reason)
        or reason.endswith("sequence gather")
        or reason.startswith("gradient of the split")  # the embeddings' sum, cut into shards
        or (c.op == "reduce_scatter" and phase == "backward")
    )


def tp_bytes(work: Workload, run: Run, meta_model: nn.Module) -> int:
    """Bytes sent in tensor-parallel collectives per step: each micro-batch's, parameter gradients'
    once. Only `full` runs collectives again: dtp train's selective and per-op policies keep every
    collective's output (dtp.train.recompute), where the simulator's per-op policy (torchtitan's)
    re-runs the all-reduces."""
    kept = replace(run, recompute="none") if run.recompute in ("selective", "op") else run
    scale = MASTER_ELEM // ELEM[run.precision]
    total = 0
    for c in tp_collectives(work, kept):
        nbytes = c.buffer_bytes * (scale if _float32_under_autocast(c, meta_model) else 1)
        times = 1 if _param_gradient(c) else run.microbatches
        total += times * sent_bytes(c.op, nbytes, run.tp)
    return total


def dp_bytes(job, checked: Checked, meta_model: nn.Module) -> int:
    """Bytes sent in data-parallel collectives per step, gradients synchronised on the last
    micro-batch only. FSDP2 (no mixed-precision policy: it moves the float32 master weights): every
    micro-batch all-gathers each unit in forward and each block unit again in backward (the root
    stays gathered); each unit's gradient is reduce-scattered once. DDP: one all-reduce of each
    unit's gradient."""
    if job.dp == 1:
        return 0
    fsdp = job.dp_mode == "fsdp"
    units = unit_bytes(checked, meta_model, job.tp, state_shards(job.dp, job.dp_mode), MASTER_ELEM)
    if not fsdp:
        return sum(sent_bytes("all_reduce", nbytes, job.dp) for _, nbytes in units)
    gathers = sum((2 if path else 1) * sent_bytes("all_gather", n, job.dp) for path, n in units)
    scatters = sum(sent_bytes("reduce_scatter", n, job.dp) for _, n in units)
    return job.batch // (job.dp * micro_batch(job)) * gathers + scatters


def state(job, checked: Checked, meta_model: nn.Module, rank: int) -> dict:
    """Parameter, gradient and AdamW state bytes of `rank` (rank = dp index · tp + tp index)."""
    shard = state_shards(job.dp, job.dp_mode)
    mine = rank if shard > 1 else rank % job.tp
    padded = param_bytes_per_rank(checked, meta_model, job.tp, shard, MASTER_ELEM)[mine]
    # AdamW's moments are shaped like the rank's own rows, without FSDP2's padding
    own = param_bytes_per_rank(checked, meta_model, job.tp, shard, MASTER_ELEM, padded=False)
    return {"parameter_bytes": padded, "gradient_bytes": padded, "optimizer_bytes": 2 * own[mine]}


def activations(work: Workload, run: Run, *, norms_kept: bool = True) -> float:
    """One micro-batch's saved activations, as the forward leaves them: K22's terms with the
    residual stream in float32 (autocast over float32 weights) and, under sequence parallelism, the
    column-parallel layers' gathered inputs (DTensor saves them whole). Under dtp train's per-op
    policy, plus the collectives' outputs it saves (`_cached`); under its selective policy, which
    keeps less than K22's selective term, `full`'s terms (each block's input, and all that is
    outside the blocks) and what torch's selective checkpointing caches in the blocks because the
    policy saves it (`_selective`).

    `norms_kept`: the blocks' norms end in an op the selective policy keeps (`_norms_kept`)."""
    shape = work.shape
    selective = run.recompute == "selective"
    saved = activation_bytes(  # selective: what full keeps, the policy's own terms added below
        shape,
        run.micro_batch,
        run.seq,
        run.tp,
        elem=ELEM[run.precision],
        recompute="full" if selective else run.recompute,
        sequence_parallel=work.sequence_parallel,
        dropout=shape.dropout,
        flash=run.attention == "flash",
        residual_elem=MASTER_ELEM,
        gathered_inputs=work.sequence_parallel,
        working_set=False,
    )
    if selective:
        return saved + _selective(work, run, norms_kept)
    return saved + _cached(work, run)


def _selective(work: Workload, run: Run, norms_kept: bool) -> float:
    """Bytes per micro-batch that dtp train's selective policy (dtp.train.recompute) keeps inside
    the blocks beyond each block's input (which the checkpoint keeps, as under `full`): the outputs
    of the ops it saves, and nothing of attention (its kernel, or an eager attention's score
    products and softmax, runs again). Per block, per token:

    - every matrix multiply's product (Shape.mm_outputs: q, k, v or a fused qkv, the projections,
      the MLP's one or two inner products and its second matrix; a row-parallel product is the
      whole width of partial sums at tp > 1), and the nonlinearity's output (GeLU; SwiGLU's
      silu(gate): the gating product runs again), in the training precision;
    - the two norms' outputs where `norms_kept` (float32, as autocast runs norms; a sequence shard
      under sequence parallelism): not an eager RMSNorm's, whose last op is a product with its
      weight;
    - at tp > 1 the collectives' outputs: the two all-reduces of the row-parallel partial sums (dtp
      reduces a copy under selective checkpointing); with sequence parallelism instead DTensor's
      two all-gathers of a norm's output (float32, whole) and two reduce-scatters' sequence shards.

    What else a block makes (views, casts, residual adds, a bias added after a reduction, the norms'
    pieces and statistics) runs again in backward. No dropout: dtp train refuses recomputation with
    dropout > 0 (the masks would be drawn again)."""
    shape, tp, sp = work.shape, run.tp, work.sequence_parallel
    elem, res, h = ELEM[run.precision], MASTER_ELEM, shape.hidden
    parallel = tp > 1
    shard = 1 / tp if sp else 1.0  # a replicated tensor's share on this rank
    products = sum(shape.mm_outputs(tp)) + (shape.ffn or 4 * h) / tp  # and the nonlinearity
    collectives = (2 * res * h + 2 * elem * h / tp) if sp else 2 * elem * h
    block = elem * products + norms_kept * 2 * res * h * shard + parallel * collectives
    return shape.layers * block * run.micro_batch * run.seq


def _cached(work: Workload, run: Run) -> float:
    """Bytes per micro-batch that dtp train's per-op policy (dtp.train.recompute.op_policy) keeps
    beyond dtp.simulate.memory's per-op terms: the collectives' outputs, which it saves. Per block
    and per norm → projection pair (two), in token × hidden tensors: at tp > 1 the reduction's
    result and, sequence parallel, the all-gather's raw output."""
    if run.recompute != "op":
        return 0.0
    elem, res = ELEM[run.precision], MASTER_ELEM
    sp, parallel = work.sequence_parallel, run.tp > 1
    shard = 1 / run.tp if sp else 1.0  # a replicated tensor's share on this rank
    pair = parallel * elem * shard + sp * res
    tokens = run.micro_batch * run.seq
    return work.shape.layers * 2 * pair * tokens * work.shape.hidden


def _norms_kept(meta_model: nn.Module, device: str) -> bool:
    """Whether the selective policy keeps the blocks' norms' outputs: a LayerNorm's (aten's
    `native_layer_norm`), and torch's RMSNorm's where torch runs it fused (`_fused_rms_norm`, on
    CUDA). An RMSNorm written out in eager ops (Hugging Face's; torch's on a CPU) ends in a product
    with its weight, which the policy runs again."""
    blocks = units(meta_model)
    if not blocks:
        return False
    norms = [
        m
        for m in meta_model.get_submodule(blocks[0]).modules()
        if isinstance(m, (nn.LayerNorm, nn.RMSNorm)) or "norm" in type(m).__name__.lower()
    ]
    return bool(norms) and all(
        isinstance(m, nn.LayerNorm) or (isinstance(m, nn.RMSNorm) and device == "cuda")
        for m in norms
    )


# the table


def table(predicted: dict, measured: dict) -> list[str]:
    """The lines `dtp train` prints: each predicted figure → the measured one (measured ÷
    predicted); one line when the simulator cannot model the run (`predicted["not_modeled"]`)."""
    if "not_modeled" in predicted:
        return [f"  predicted (dtp simulate): not modeled ({predicted['not_modeled']})"]
    name = predicted.get("profile")
    lines = [
        f"  predicted (dtp simulate, {f'profile {name}' if name else 'no profile'}) beside "
        "measured, per rank (measured ÷ predicted):",
        _row(
            "collective bytes / step",
            f"tp {_pair(predicted, measured, 'tp_bytes', _size)}   "
            f"dp {_pair(predicted, measured, 'dp_bytes', _size)}",
        ),
    ]
    for label, key in (
        ("parameters", "parameter_bytes"),
        ("gradients", "gradient_bytes"),
        ("AdamW state", "optimizer_bytes"),
        ("saved activations", "activation_bytes"),
    ):
        lines.append(_row(label, _pair(predicted, measured, key, _size)))
    if predicted.get("step_ms") is None:
        why = predicted.get("step_note") or (
            "no --profile: dtp simulate --calibrate -o this.yaml, then --profile this.yaml"
        )
        step = f"— ({why})"
    else:
        step = _pair(predicted, measured, "step_ms", lambda ms: f"{ms:.1f} ms")
    lines.append(_row("step time", step))
    return lines


def _row(label: str, text: str) -> str:
    return f"    {label:<26}{text}"


def _pair(predicted: dict, measured: dict, key: str, fmt) -> str:
    """`predicted → measured (ratio)`; a missing figure is a dash."""
    p, m = predicted.get(key), measured.get(key)
    left = "—" if p is None else fmt(p)
    right = "—" if m is None else fmt(m)
    ratio = f" ({m / p:.3f})" if p and m is not None else ""
    return f"{left} → {right}{ratio}"


def _size(nbytes: float) -> str:
    """Bytes in binary units, three significant places: 512 B, 1.50 KiB, 12.3 MiB."""
    value, unit = float(nbytes), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024:
            break
        value, unit = value / 1024, bigger
    if unit == "B":
        return f"{value:.0f} B"
    return f"{value:.{max(0, 2 - len(str(int(abs(value)))) + 1)}f} {unit}"
