"""Microbenchmarks of the kernels a CPU rank runs, on one thread, each named by what it prices in
`kernels.py`: GEMM rate by layout (the forward's x·Wᵀ, the backward's dy·W and dyᵀ·x) on
Linear-shaped matmuls, the fused attention kernel's rate and backward ratio, each memory-bound aten
op's forward bandwidth over the elements `ops.Recorder` counts for it and its backward ÷ forward,
the SGD step's bandwidth, and the fixed cost of one op's forward and backward. Nothing here runs a
model or a training step."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from dtp.compiler.vocab_parallel import cross_entropy
from dtp.simulate.ops import Recorder

TOKENS = (256, 1024, 4096)  # rows of a Linear's input (batch × sequence)
WIDTHS = (128, 256, 512, 1024)  # its in and out features: n → n, n → 4n, 4n → n
FLUSH_ELEMENTS = 1 << 23  # 32 MB: more than this machine's L2 caches together
# the size memory-bound ops are timed at: a GPT's activations (the loss: 4×)
MEMORY_ELEMENTS = 1 << 20


def _typical(fn: Callable[[], object], reps: int = 9, cold: bool = False) -> float:
    """Seconds of the median of `reps` calls after two warm-ups: a training step runs each kernel
    once, so the typical call, not the fastest (the fastest was 5-10 % optimistic against the ops'
    times inside a step). `cold`: the caches are flushed before each call, as in a step, where a
    memory-bound op reads activations written long before (its pages are mapped already: the
    allocator reuses a step's memory in the next)."""
    flush = torch.zeros(FLUSH_ELEMENTS) if cold else None
    fn(), fn()
    times = []
    for _ in range(reps):
        if flush is not None:
            flush.add_(1.0)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gemm_layouts() -> tuple[float, dict[float, float], dict[float, float]]:
    """(the fastest FLOP/s, forward table, backward table): GFLOP of one Linear GEMM → its rate as a
    fraction of the fastest. Timed as a model's Linear runs: F.linear on a (batch, 128, in) input
    with a bias; its backward through autograd (dx = dy·W and dW = dyᵀ·x in their transposed
    layouts, the bias gradient's sum and the copies the CPU kernels make), as two GEMMs' FLOPs.
    Shapes of equal GFLOP (within 5 %) are averaged: the simulator knows an op's FLOPs, not its
    shape."""
    forward: dict[float, list[float]] = {}
    backward: dict[float, list[float]] = {}
    for m in TOKENS:
        for n in WIDTHS:
            for k, o in ((n, n), (n, 4 * n), (4 * n, n)):
                flops = 2 * m * k * o
                if flops > 8e9:
                    continue  # seconds each: beyond what a rank of this machine multiplies
                x = torch.randn(m // 128, 128, k, requires_grad=True)
                w, b = torch.randn(o, k, requires_grad=True), torch.randn(o, requires_grad=True)
                dy = torch.randn(m // 128, 128, o)
                key = round(flops / 1e9, 4)
                ahead = _typical(lambda: F.linear(x, w, b))
                both = _typical(lambda: torch.autograd.grad(F.linear(x, w, b), (x, w, b), dy))
                forward.setdefault(key, []).append(flops / ahead)
                backward.setdefault(key, []).append(2 * flops / max(both - ahead, 1e-9))
    top = max(max(r) for r in forward.values())
    return top, _table(forward, top), _table(backward, top)


def _table(rates: dict[float, list[float]], top: float) -> dict[float, float]:
    """GFLOP → mean fraction of `top`, neighbours within 5 % merged (at most 32 entries)."""
    merged: list[tuple[float, list[float]]] = []
    for g in sorted(rates):
        if merged and g <= merged[-1][0] * 1.05:
            merged[-1][1].extend(rates[g])
        else:
            merged.append((g, list(rates[g])))
    while len(merged) > 32:  # the profile's limit: merge the closest neighbours
        i = min(range(len(merged) - 1), key=lambda j: merged[j + 1][0] / merged[j][0])
        merged[i : i + 2] = [(merged[i][0], merged[i][1] + merged[i + 1][1])]
    return {g: min(1.0, statistics.fmean(r) / top) for g, r in merged}


def attention(
    gemm_rate: float, batch_heads: int = 32, seq: int = 256, head_dim: int = 64
) -> tuple[float, float]:
    """(SDPA's forward FLOP rate ÷ `gemm_rate`, backward ÷ forward) of causal attention: FLOPs
    counted as ops.py records them (QKᵀ and × V in full, 4·s²·d per head)."""
    q, k, v = (torch.randn(1, batch_heads, seq, head_dim, requires_grad=True) for _ in range(3))
    forward = _typical(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    grad = torch.randn(1, batch_heads, seq, head_dim)

    def step() -> None:
        torch.autograd.grad(
            F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), grad
        )

    both = _typical(step)
    flops = 4 * batch_heads * seq * seq * head_dim
    return min(1.0, flops / forward / gemm_rate), max(0.5, (both - forward) / forward)


def _memory_cases(n: int) -> dict[str, tuple[Callable[[], tuple], Callable]]:
    """aten op → (inputs, forward) for the memory-bound ops a transformer's forward and loss run."""
    h, vocab = 512, 4096
    rows = n // h
    ln = torch.nn.LayerNorm(h)
    logits = 4 * n  # the loss runs over batch × sequence × vocabulary: larger than any activation
    targets = torch.randint(0, vocab, (logits // vocab,))
    ids = torch.randint(0, 8 * vocab, (rows,))
    return {
        "add": (lambda: (torch.randn(n, requires_grad=True), torch.randn(n)), lambda x, y: x + y),
        "mul": (lambda: (torch.randn(n, requires_grad=True), torch.randn(n)), lambda x, y: x * y),
        "gelu": (lambda: (torch.randn(n, requires_grad=True),), lambda x: F.gelu(x)),
        "gelu.tanh": (
            lambda: (torch.randn(n, requires_grad=True),),
            lambda x: F.gelu(x, approximate="tanh"),
        ),
        "native_layer_norm": (lambda: (torch.randn(rows, h, requires_grad=True),), lambda x: ln(x)),
        "clone": (
            lambda: (torch.randn(rows, 8, h // 8, requires_grad=True),),
            lambda x: x.transpose(0, 1).contiguous(),
        ),
        "embedding": (
            lambda: (torch.nn.Parameter(torch.randn(8 * vocab, h // 2)),),
            lambda w: F.embedding(ids, w),
        ),
        "_log_softmax": (
            lambda: (torch.randn(logits // vocab, vocab, requires_grad=True),),
            lambda x: F.log_softmax(x, -1),
        ),
        "nll_loss_forward": (
            lambda: (torch.randn(logits // vocab, vocab, requires_grad=True),),
            lambda x: F.nll_loss(x, targets),
        ),
        # what the meta device records after a batched matmul: a reshape that moves nothing on a CPU
        "_unsafe_view": (
            lambda: (torch.randn(8, rows, h // 8, requires_grad=True),),
            lambda x: torch.ops.aten._unsafe_view(x, (8 * rows, h // 8)),
        ),
    }


def _backward_seconds(
    forward: Callable[[], torch.Tensor], leaf: torch.Tensor, grad: torch.Tensor, reps: int = 9
) -> float:
    """Median seconds of an op's own backward kernels (its forward run untimed before each): the
    gradient is handed on, not accumulated, and freed as a step's backward frees it."""
    flush, times = torch.zeros(FLUSH_ELEMENTS), []
    for _ in range(reps + 2):
        out = forward()
        flush.add_(1.0)
        t0 = time.perf_counter()
        torch.autograd.grad(out, leaf, grad)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def memory_ops(n: int = MEMORY_ELEMENTS) -> tuple[dict[str, float], dict[str, float]]:
    """(aten op → forward GB/s over the floating-point elements ops.Recorder counts for it × 4
    bytes, aten op → backward time ÷ forward time), each op allocating its output as in training."""
    bandwidth, ratio = {}, {}
    for name, (make, fn) in _memory_cases(n).items():
        args = make()
        recorder = Recorder()
        with recorder, torch.no_grad():
            fn(*args)
        elements = sum(r[3] + r[5] for r in recorder.raw if r[1] == "memory" and r[4] == name)
        leaf = args[0]
        forward = _typical(lambda: fn(*args), cold=True)
        grad = torch.randn_like(fn(*args))
        backward = _backward_seconds(lambda: fn(*args), leaf, grad)
        both = forward + backward
        bandwidth[name] = 4 * elements / forward / 1e9
        ratio[name] = max(0.05, (both - forward) / forward)
        # its backward writes a dense gradient of the whole table:
        if isinstance(leaf, torch.nn.Parameter):
            # priced per table element
            bandwidth[name + ".grad"] = 4 * leaf.numel() / (both - forward) / 1e9
            # the rows' scatter-add: assumed to cost their gather (a few % of the above)
            ratio[name] = 1.0
    return bandwidth, ratio


def parallel_loss(world: int = 2, n: int = 4 * MEMORY_ELEMENTS) -> tuple[float, float, str]:
    """(GB/s over the traffic ops.py records for the loss's log-softmax on one rank's vocabulary
    shard, backward ÷ forward, which implementation) of the vocabulary-parallel cross-entropy as dtp
    runs it at tp `world` (dtp.compiler.vocab_parallel's): several passes (row maxima, shift, exp,
    sums, normalise) where one kernel runs unsharded. Timed in this process over a fake `world`-rank
    group: its collectives do nothing (their time is the all-reduces' own, priced as communication)."""
    vocab = 4096
    rows = n // vocab
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        local = torch.randn(1, rows, vocab // world, requires_grad=True)
        targets = torch.randint(0, vocab, (1, rows))

        def forward() -> torch.Tensor:
            return cross_entropy(
                DTensor.from_local(local, mesh, [Shard(-1)], run_check=False), targets
            )

        ahead = _typical(forward, cold=True)
        back = _backward_seconds(forward, local, torch.ones(()))
        return (
            4 * 2 * rows * vocab / world / ahead / 1e9,
            max(0.05, back / ahead),
            "dtp.compiler.vocab_parallel",
        )
    finally:
        dist.destroy_process_group()


def sgd_dtensor_tensor(rank: int, world: int, small: int = 64) -> float:
    """Seconds per parameter tensor of torch's SGD step with momentum on sharded (DTensor)
    parameters of 16 elements each, on a real `world`-rank group (run on ranks:
    dtp.runtime.ranks.on_ranks): DTensor's dispatch of every op, which a sharded model's optimizer
    pays per tensor."""
    mesh = init_device_mesh("cpu", (world,))
    ps = [
        torch.nn.Parameter(DTensor.from_local(torch.randn(16), mesh, [Shard(0)]))
        for _ in range(small)
    ]
    for p in ps:
        p.grad = DTensor.from_local(torch.randn(16), mesh, [Shard(0)])
    opt = torch.optim.SGD(ps, lr=1e-6, momentum=0.9)
    return _typical(opt.step) / small


def _sgd_seconds(params: int, tensors: int) -> float:
    ps = [torch.randn(params // tensors, requires_grad=True) for _ in range(tensors)]
    for p in ps:
        p.grad = torch.randn_like(p)
    opt = torch.optim.SGD(ps, lr=1e-6, momentum=0.9)
    return _typical(opt.step)


def sgd_step(params: int = 1 << 22, tensors: int = 8, small: int = 64) -> tuple[float, float]:
    """(GB/s of torch's SGD step with momentum over the 20 bytes per fp32 parameter model.py counts:
    read the gradient, read and write the weight and the momentum; seconds per parameter tensor,
    from `small` tensors of 16 elements: its per-tensor loop, which a model's many small biases and
    norms pay)."""
    per_tensor = _sgd_seconds(small * 16, small) / small
    return 20 * params / max(
        _sgd_seconds(params, tensors) - tensors * per_tensor, 1e-9
    ) / 1e9, per_tensor


def overheads(reps: int = 400) -> tuple[float, float]:
    """(seconds of one eager op's forward, of its backward) on one-element tensors: dispatch and the
    autograd engine, no work (the median of batches: a batch long enough to be preempted)."""
    x = torch.ones(1, requires_grad=True)

    def chain() -> torch.Tensor:
        y = x
        for _ in range(reps):
            y = y * 1.0
        return y

    fwd, both = [], []
    for _ in range(7):
        t0 = time.perf_counter()
        y = chain()
        t1 = time.perf_counter()
        y.backward()
        t2 = time.perf_counter()
        fwd.append((t1 - t0) / reps)
        both.append((t2 - t1) / reps)
    return statistics.median(fwd), statistics.median(both)


def single_thread(fn: Callable[[], object]) -> object:
    """`fn()` on one intra-op thread, as each `dtp apply` rank runs here."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)
