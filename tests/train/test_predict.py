"""`dtp train`'s prediction beside its measurement: the activation meter under every recompute
policy, the predicted figures against dtp.cost's tables and the meter, and the printed table."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from dtp import models
from dtp.checks.checker import check
from dtp.compiler.vocab_parallel import cross_entropy
from dtp.cost.param_bytes import param_bytes_per_rank
from dtp.cost.schedule import schedule, summarize
from dtp.lang.parse import load, read_plan_text
from dtp.runtime.launcher import launch_local
from dtp.simulate.profile import load as load_profile
from dtp.train.activations import ForwardMeter, GroupCounter, collective_bytes, state_bytes
from dtp.train.optim import adamw
from dtp.train.predict import KEYS, _norms_kept, predict, table
from dtp.train.recompute import recompute_blocks
from dtp.train.verify import AUTOCAST
from dtp.verify.instruments import ActivationMeter

PLAN = "plans/gpt2.tp"
# gpt2-tiny: 2 layers, width 64, 4 heads, vocabulary 256. seq ≠ width: a (batch, seq, width) tensor
# must not look like attention scores (seq × seq) to the selective policy.
BATCH, SEQ = 4, 32
# Hugging Face's eager Llama (dtp.models.hf): 2 layers, width 64, 4 heads (2 key/value), SwiGLU
# 128 wide, vocabulary 128; attention as matmuls and a softmax on (seq × seq) scores
HF_LLAMA, HF_PLAN = "dtp.models.hf:llama", "plans/hf/llama.tp"


@dataclass(frozen=True)
class Job:
    """The fields of dtp train's job that the prediction reads."""

    plan: str = PLAN
    plan_text: str | None = None
    model: str = "gpt2-tiny"
    tp: int = 1
    dp: int = 1
    batch: int = BATCH
    seq: int = SEQ
    micro_batch: int | None = None
    recompute: str = "none"
    dtype: str = "float32"
    dp_mode: str = "fsdp"
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.plan_text is None:
            object.__setattr__(self, "plan_text", read_plan_text(self.plan))


def _model(recompute: str, seed: int = 0, name: str = "gpt2-tiny") -> torch.nn.Module:
    torch.manual_seed(seed)
    model = models.build(name, device="cpu")
    recompute_blocks(model, recompute, SEQ)
    return model


def _batch(vocab: int = 256):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    return ids, torch.randint(0, vocab, (BATCH, SEQ), generator=g)


def _loss(model, ids, targets, dtype: str) -> torch.Tensor:
    with torch.autocast("cpu", dtype=AUTOCAST.get(dtype), enabled=dtype in AUTOCAST):
        logits = model(ids)
    return cross_entropy(getattr(logits, "logits", logits), targets)  # a Hugging Face output's


def _measured_activations(recompute: str, dtype: str, name: str = "gpt2-tiny") -> ForwardMeter:
    model = _model(recompute, name=name)
    ids, targets = _batch(models.vocab_size(model))
    with ForwardMeter(model) as meter:
        loss = _loss(model, ids, targets, dtype)
    loss.backward()
    return meter


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("recompute", ["none", "full", "selective", "op"])
def test_predicted_activations_are_what_the_forward_leaves(repo, recompute, dtype):
    meter = _measured_activations(recompute, dtype)
    job = Job(recompute=recompute, dtype=dtype)
    predicted = predict(job, models.build("gpt2-tiny", device="meta"))["activation_bytes"]
    # the issue's bound is 10 %; what the model leaves out (token ids, the norms' mean and rstd)
    # is under 1 % here
    assert predicted == pytest.approx(meter.nbytes, rel=0.02), (predicted, meter.nbytes)
    # autocast's bfloat16 copies of the weights, apart (the simulator counts them as weights)
    assert (meter.weight_copies > 0) == (dtype == "bfloat16")


@pytest.mark.parametrize(
    "name, plan, dtype",
    [
        ("llama-tiny", "plans/llama.tp", "float32"),
        ("llama-tiny", "plans/llama.tp", "bfloat16"),
        (HF_LLAMA, HF_PLAN, "float32"),
    ],
)
def test_selective_prediction_on_llamas(repo, name, plan, dtype):
    # separate q/k/v, SwiGLU and RMSNorms written out in eager ops (torch's on a CPU, Hugging
    # Face's), whose outputs the policy runs again; within the blocks the prediction is exact, what
    # it leaves out is outside them, as under `full` (the final norm's product with its inverse
    # RMS, RoPE's tables, Hugging Face's float causal mask): 4 to 7 % here
    meter = _measured_activations("selective", dtype, name)
    job = Job(plan=plan, model=name, recompute="selective", dtype=dtype)
    predicted = predict(job, models.build(name, device="meta"))["activation_bytes"]
    assert predicted == pytest.approx(meter.nbytes, rel=0.10), (predicted, meter.nbytes)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_selective_keeps_less_than_no_recomputation_on_an_eager_llama(repo, dtype):
    # the policy's point: on an eager attention (softmax, masks, score products, each kept without
    # recomputation) it keeps the products and the nonlinearity and runs all the rest again; the
    # policy that kept everything but attention kept 1.75 × what `none` keeps here
    none = _measured_activations("none", dtype, HF_LLAMA).nbytes
    selective = _measured_activations("selective", dtype, HF_LLAMA).nbytes
    assert selective < 0.75 * none, (selective, none)


def test_selective_keeps_the_norms_torch_runs_as_one_op(repo):
    # a LayerNorm is aten's native_layer_norm anywhere; torch's RMSNorm one _fused_rms_norm on CUDA
    # only (written out on a CPU); Hugging Face's RMSNorm is eager code everywhere
    for name, kept in (
        ("gpt2-tiny", (True, True)),
        ("llama-tiny", (False, True)),
        (HF_LLAMA, (False, False)),
    ):
        meta = models.build(name, device="meta")
        assert (_norms_kept(meta, "cpu"), _norms_kept(meta, "cuda")) == kept, name
    # on CUDA the selective prediction adds each block's two float32 norm outputs
    meta = models.build("llama-tiny", device="meta")
    cpu, cuda = (
        predict(
            Job(plan="plans/llama.tp", model="llama-tiny", recompute="selective", device=device),
            meta,
        )["activation_bytes"]
        for device in ("cpu", "cuda")
    )
    assert cuda - cpu == 2 * 2 * 4 * BATCH * SEQ * 64  # layers · norms · float32 · tokens · width


def test_the_meter_agrees_with_saved_tensor_hooks_where_those_see_everything(repo):
    model = _model("none")
    ids, targets = _batch()
    hooks = ActivationMeter(model)
    with ForwardMeter(model) as meter, hooks.recording():
        loss = _loss(model, ids, targets, "float32")
    # the hooks also see the token ids the embedding saves (allocated before the forward); the meter
    # also the loss, which nothing saves but the caller holds
    ids_bytes, loss_bytes = ids.numel() * ids.element_size(), loss.numel() * loss.element_size()
    assert hooks.nbytes - meter.nbytes == ids_bytes - loss_bytes
    loss.backward()


def test_checkpointing_hides_from_saved_tensor_hooks_not_from_the_meter(repo):
    model = _model("op")
    ids, targets = _batch()
    hooks = ActivationMeter(model)
    with ForwardMeter(model) as meter, hooks.recording():
        loss = _loss(model, ids, targets, "float32")
    loss.backward()
    # the hooks see only what is saved outside the blocks; the per-op policy keeps more
    assert meter.nbytes > 2 * hooks.nbytes


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_the_meter_leaves_gradients_bit_identical(repo, recompute):
    grads = []
    for metered in (False, True):
        model = _model(recompute)
        ids, targets = _batch()
        with (
            ForwardMeter(model)
            if metered
            else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        ):
            loss = _loss(model, ids, targets, "float32")
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_state_is_the_param_bytes_table(repo):
    meta = models.build("gpt2-tiny", device="meta")
    checked = check(load(PLAN), meta, 2)
    table_ = param_bytes_per_rank(checked, meta, 2)
    for rank in (0, 1):
        got = predict(Job(tp=2), meta, rank=rank)
        assert got["parameter_bytes"] == got["gradient_bytes"] == table_[rank]
        assert got["optimizer_bytes"] == 2 * table_[rank]  # AdamW's two float32 moments
    # one rank, measured: every storage once, the tied head counted once
    model = _model("none")
    optimizer = adamw(model, 1e-3, 0.1)
    ids, targets = _batch()
    _loss(model, ids, targets, "float32").backward()
    optimizer.step()
    measured = state_bytes(model, optimizer)
    predicted = predict(Job(), meta)
    assert {k: predicted[k] for k in measured} == measured


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_tp_bytes_are_the_analytic_schedule(repo, recompute):
    meta = models.build("gpt2-tiny", device="meta")
    checked = check(load(PLAN), meta, 2)
    micro = 2
    steps = schedule(
        checked, 2, BATCH, SEQ, checkpoint_activations=recompute == "full", micro_batches=micro
    )
    analytic = sum(summarize(steps, 2)["sent_bytes"].values())
    job = Job(tp=2, micro_batch=BATCH // micro, recompute=recompute)
    assert predict(job, meta)["tp_bytes"] == analytic


def test_step_time_needs_a_profile_with_the_runs_precision(repo):
    meta = models.build("gpt2-tiny", device="meta")
    assert predict(Job(), meta)["step_ms"] is None
    with_profile = predict(Job(), meta, load_profile("dgx2h-v100"))
    assert with_profile["profile"] == "dgx2h-v100" and with_profile["step_ms"] > 0
    # a V100 has no bfloat16 (and a CPU calibration measures float32 only): said, not raised
    bf16 = predict(Job(dtype="bfloat16"), meta, load_profile("dgx2h-v100"))
    assert bf16["step_ms"] is None
    assert bf16["step_note"] == "profile dgx2h-v100 has no bf16 GEMM rate, only fp16, fp32"
    assert table(bf16, {})[-1].endswith(
        "— (profile dgx2h-v100 has no bf16 GEMM rate, only fp16, fp32)"
    )


def test_table_lines():
    predicted = {
        "profile": "this-machine",
        "tp_bytes": 1.5 * 2**20,
        "dp_bytes": 0,
        "parameter_bytes": 251136,
        "gradient_bytes": 251136,
        "optimizer_bytes": 502272,
        "activation_bytes": 600000.0,
        "step_ms": 40.0,
    }
    measured = {**predicted, "dp_bytes": 0, "activation_bytes": 612492, "step_ms": 44.0}
    assert table(predicted, measured) == [
        "  predicted (dtp simulate, profile this-machine) beside measured, per rank (measured ÷ "
        "predicted):",
        "    collective bytes / step   tp 1.50 MiB → 1.50 MiB (1.000)   dp 0 B → 0 B",
        "    parameters                245 KiB → 245 KiB (1.000)",
        "    gradients                 245 KiB → 245 KiB (1.000)",
        "    AdamW state               490 KiB → 490 KiB (1.000)",
        "    saved activations         586 KiB → 598 KiB (1.021)",
        "    step time                 40.0 ms → 44.0 ms (1.100)",
    ]
    unprofiled = table({**predicted, "profile": None, "step_ms": None}, measured)
    assert unprofiled[0].startswith("  predicted (dtp simulate, no profile) beside measured")
    assert unprofiled[-1] == (
        "    step time                 — (no --profile: dtp simulate --calibrate -o this.yaml, "
        "then --profile this.yaml)"
    )


def _sharded(job):
    """`job`'s model on this rank's (dp, tp) mesh as dtp train builds it, its blocks recomputed as
    the job says; (mesh, meta model, model)."""
    from torch.distributed.device_mesh import init_device_mesh

    from dtp.lang.parse import parse
    from dtp.runtime.build import build_sharded

    mesh = init_device_mesh("cpu", (job.dp, job.tp), mesh_dim_names=("dp", "tp"))
    meta = models.build(job.model, device="meta")
    checked = check(parse(job.plan_text, job.plan), meta, job.tp)
    model = build_sharded(
        checked,
        models.resolve(job.model),
        mesh,
        seed=1,
        device=torch.device("cpu"),
        dp=job.dp,
        dp_mode=job.dp_mode,
    ).model
    recompute_blocks(model, job.recompute, job.seq)
    return mesh, meta, model


def _rank(rank, world, job):
    """One step of `job` on this rank as dtp train runs it, measured; and its prediction."""
    from torch.distributed.fsdp import FSDPModule

    from dtp.train.optim import settle_grads

    mesh, meta, model = _sharded(job)
    optimizer = adamw(model, 1e-3, 0.1)
    counters = [GroupCounter({"tp": mesh["tp"].get_group(), "dp": mesh["dp"].get_group()})]
    micro = job.batch // (job.dp * job.micro_batch)
    g = torch.Generator().manual_seed(rank // job.tp)
    activations = None  # the first micro-batch's
    for i in range(micro):
        if isinstance(model, FSDPModule):  # as dtp train: the gradient reduced once, at the end
            model.set_requires_gradient_sync(i == micro - 1)
        ids, targets = torch.randint(0, 256, (2, job.micro_batch, job.seq), generator=g)
        with counters[0], ForwardMeter(model) as meter:
            loss = _loss(model, ids, targets, job.dtype) / micro
        activations = meter.nbytes if activations is None else activations
        with counters[0]:
            loss.backward()
    with counters[0]:
        settle_grads([p for p in model.parameters() if p.grad is not None])
        optimizer.step()
    measured = {
        **collective_bytes(counters),
        **state_bytes(model, optimizer),
        "activation_bytes": activations,
    }
    return predict(job, meta, rank=rank), measured


@pytest.mark.parametrize(
    "job",
    [
        # sequence parallelism, autocast, the per-op policy, FSDP2: what the prediction adds to the
        # simulator's terms
        Job(
            plan="plans/gpt2-sp.tp",
            tp=2,
            dp=2,
            batch=8,
            micro_batch=2,
            recompute="op",
            dtype="bfloat16",
        ),
        # an all-reduce before the rowwise bias, torch's SAC cache, DDP
        Job(tp=2, dp=2, batch=8, micro_batch=2, recompute="selective", dp_mode="ddp"),
    ],
    ids=["sp-bf16-op-fsdp", "fp32-selective-ddp"],
)
def test_prediction_beside_a_measured_step_on_a_tp_2_dp_2_mesh(repo, job):
    for predicted, measured in launch_local(_rank, 4, job, timeout=120):
        for key in ("tp_bytes", "dp_bytes", "parameter_bytes", "gradient_bytes", "optimizer_bytes"):
            assert predicted[key] == measured[key], key
        assert predicted["activation_bytes"] == pytest.approx(
            measured["activation_bytes"], rel=0.02
        )
        assert set(KEYS) - {"step_ms"} <= set(measured)


def _forward_rank(rank, world, job):
    """(predicted, measured) activation bytes of one forward of `job` on this rank."""
    _, meta, model = _sharded(job)
    g = torch.Generator().manual_seed(rank // job.tp)
    ids, targets = torch.randint(0, models.vocab_size(meta), (2, job.batch, job.seq), generator=g)
    with ForwardMeter(model) as meter:
        loss = _loss(model, ids, targets, job.dtype)
    loss.backward()
    return predict(job, meta, rank=rank)["activation_bytes"], meter.nbytes


@pytest.mark.parametrize(
    "job, rel",
    [
        # DTensor's all-gathers (of the norms' float32 outputs, whole) and reduce-scatters
        (Job(plan="plans/gpt2-sp.tp", tp=2, recompute="selective", dtype="bfloat16"), 0.02),
        # dtp's all-reduces of a copy of the row-parallel partial sums; the bias added after
        (Job(tp=2, recompute="selective", dtype="bfloat16"), 0.02),
        # q/k/v sharing one input; what is left out is outside the blocks (as at tp 1)
        (Job(plan="plans/llama.tp", model="llama-tiny", tp=2, recompute="selective"), 0.10),
        (Job(plan=HF_PLAN, model=HF_LLAMA, tp=2, recompute="selective"), 0.10),
    ],
    ids=["gpt2-sp-bf16", "gpt2-bf16", "llama-fp32", "hf-llama-fp32"],
)
def test_selective_prediction_on_a_tp_2_mesh(repo, job, rel):
    for predicted, measured in launch_local(_forward_rank, 2, job, timeout=120):
        assert predicted == pytest.approx(measured, rel=rel), (predicted, measured)
