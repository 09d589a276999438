"""The human report of one simulated iteration."""

from __future__ import annotations

from dtp.errors import UsageError
from dtp.files import write_text
from dtp.simulate.flops import narayanan_flops
from dtp.simulate.model import Result
from dtp.simulate.prepare import Prepared
from dtp.simulate.profile import Profile

GiB = 1024**3


def write_output(path: str, text: str) -> None:
    """Write a result file the user named (a regular file only, replaced atomically); UsageError if
    it cannot be."""
    try:
        write_text(path, text)
    except OSError as err:
        raise UsageError(f"cannot write {path}: {err.strerror}") from None


def render(r: Result, prepared: Prepared, prof: Profile, seconds: float) -> str:
    """A few aligned lines: what ran (the model and plan as `prepared` names them), time breakdown,
    throughput, memory, the FLOP cross-check."""
    run, mem, shape = r.run, r.memory, prepared.shape
    overlap = "overlapped with backward" if run.dp_overlap else "after backward"
    if run.fsdp:
        dp_line = (
            f"DP comm      FSDP all-gathers (forward and backward) + fp32 reduce-scatters "
            f"{r.dp_sent_bytes / GiB:.3f} GiB sent per rank, {r.dp_comm_total_s:.4g} s, prefetched "
            "behind each block"
        )
    else:
        dp_line = (
            f"DP comm      gradient all-reduce {r.dp_sent_bytes / GiB:.3f} GiB sent per rank, "
            f"{r.dp_comm_total_s:.4g} s, {overlap}"
        )
    lines = [
        f"{prepared.model_spec} with {prepared.plan_path} on {prof.name}: tp {run.tp} × dp "
        f"{run.dp}{' (FSDP)' if run.fsdp else ''} = "
        f"{run.gpus} GPUs, micro-batch {run.micro_batch} × {run.microbatches}, global batch "
        f"{run.global_batch}, "
        f"seq {run.seq}, {run.precision}, recompute {run.recompute}, {run.optimizer}, "
        f"{run.attention} attention"
        f"{', compiled' if run.compile else ''}{', TP overlapped with weight gradients' if run.tp_overlap else ''}",
        f"iteration    {r.iteration_s:.4g} s = compute {r.compute_s:.4g} + TP comm "
        f"{r.tp_comm_s:.4g} "
        f"+ DP comm {r.dp_comm_s:.4g} + optimizer {r.optimizer_s:.4g}",
        f"TP comm      {r.tp_collectives} collectives per rank, {r.tp_sent_bytes / GiB:.3f} GiB "
        "sent per rank",
        dp_line,
        f"throughput   {r.tflops_per_gpu:.2f} TFLOP/s per GPU (hardware FLOPs, recompute counted), "
        f"{r.aggregate_pflops:.4g} PFLOP/s aggregate, {r.tokens_per_s_per_gpu:,.0f} tokens/s per "
        "GPU; "
        f"model FLOPs {r.model_flops_per_iteration:.4g} per iteration",
        f"memory/GPU   weights {mem.weights / GiB:.2f} + grads {mem.grads / GiB:.2f} + optimizer "
        f"{mem.optimizer / GiB:.2f} + activations {mem.activations / GiB:.2f} + transient "
        f"{mem.buffers / GiB:.2f} "
        f"= {mem.total / GiB:.2f} GiB of "
        f"{mem.capacity / GiB:.0f}: {'fits' if mem.fits else 'DOES NOT FIT'}",
    ]
    if run.recompute == "full":
        eq3 = narayanan_flops(run.global_batch, run.seq, shape.layers, shape.hidden, shape.vocab)
        lines.append(
            f"FLOPs        counted on the model = {r.flops_per_iteration / eq3:.4f} × Narayanan et "
            "al. eq. 3, "
            f"96·B·s·l·h²(1 + s/6h + V/16lh) (a GPT's: 4h MLP, tied head)"
        )
    lines.append(
        f"({seconds:.1f} s, meta device; profile calibrated: {prof.calibrated or 'nothing'})"
    )
    return "\n".join(lines)
