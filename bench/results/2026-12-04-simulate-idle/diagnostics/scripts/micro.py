"""Diagnostic microbenchmarks on one thread."""
import time, statistics, sys, os, json
import torch, torch.nn.functional as F
torch.set_num_threads(1)
def best(fn, reps=7, warm=2):
    for _ in range(warm): fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return min(ts), statistics.median(ts)
out = {"load": os.getloadavg()}
print("load", os.getloadavg())
shapes = [(n, n, n) for n in (128, 256, 512, 1024)]
for h in (256, 512):
    for tp in (1, 2, 4):
        shapes += [(1024, h, 3*h//tp), (1024, h//tp, h), (1024, h, 4*h//tp), (1024, 4*h//tp, h), (1024, h, 16*h//tp)]
shapes = sorted(set(shapes))
print("M K N | GFLOP | fwd(addmm x W^T) GF/s | dx (dy W) | dW (dy^T x) | square-equivalent")
g = {}
for M, K, N in shapes:
    x, W, b, dy = torch.randn(M, K), torch.randn(N, K), torch.randn(N), torch.randn(M, N)
    fl = 2 * M * K * N
    f = best(lambda: torch.addmm(b, x, W.t()))[0]
    dx = best(lambda: dy.mm(W))[0]
    dw = best(lambda: dy.t().mm(x))[0]
    g[f"{M}x{K}x{N}"] = (fl / f, fl / dx, fl / dw)
    print(M, K, N, f"{fl/1e9:.4f}", f"{fl/f/1e9:.1f}", f"{fl/dx/1e9:.1f}", f"{fl/dw/1e9:.1f}", flush=True)
out["gemm"] = g
# memory-bound ops: forward and backward time per element of the output
print("op | n | fwd ms | bwd ms | fwd GB/s over (in+out) elements")
mem = {}
def mop(name, make, n):
    xs = make(n)
    x = xs[0]
    def fwd():
        return xs[-1](x)
    f = best(lambda: fwd())[0]
    y = fwd(); gy = torch.randn_like(y)
    def fb():
        x.grad = None
        y2 = fwd(); y2.backward(gy)
    fbt = best(fb)[0]
    mem[f"{name}/{n}"] = (f, fbt - f)
    print(name, n, f"{f*1e3:.3f}", f"{(fbt-f)*1e3:.3f}", flush=True)
for n in (1 << 18, 1 << 20, 1 << 22):
    mop("add", lambda n: (torch.randn(n, requires_grad=True), (lambda t, o=torch.randn(n): t + o)), n)
    mop("mul", lambda n: (torch.randn(n, requires_grad=True), (lambda t, o=torch.randn(n): t * o)), n)
    mop("gelu", lambda n: (torch.randn(n, requires_grad=True), (lambda t: F.gelu(t))), n)
    for hdim in (256, 512):
        mop(f"layer_norm{hdim}", lambda n, hdim=hdim: (torch.randn(n // hdim, hdim, requires_grad=True),
            (lambda t, ln=torch.nn.LayerNorm(hdim): ln(t))), n)
    mop("log_softmax4096", lambda n: (torch.randn(n // 4096, 4096, requires_grad=True), (lambda t: F.log_softmax(t, -1))), n)
    mop("cross_entropy4096", lambda n: (torch.randn(n // 4096, 4096, requires_grad=True),
        (lambda t, y=torch.randint(0, 4096, (n // 4096,)): F.cross_entropy(t, y))), n)
    mop("embedding256", lambda n: (torch.randn(n // 256, 256, requires_grad=True),
        (lambda t, i=torch.randint(0, n // 256, (1024,)): F.embedding(i, t))), n)
out["mem"] = mem
for B, H in ((8, 4), (8, 2), (8, 1), (8, 8)):
    q, k, v = (torch.randn(B, H, 128, 64, requires_grad=True) for _ in range(3))
    f = best(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))[0]
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True); gy = torch.randn_like(y)
    def fb():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(gy)
    fbt = best(fb)[0]
    fl = 4 * B * H * 128 * 128 * 64
    print("sdpa", B, H, f"fwd {f*1e3:.3f} ms ({fl/f/1e9:.1f} GF/s of full-matrix flops)  bwd {(fbt-f)*1e3:.3f} ms", flush=True)
# per-op overhead, forward and backward
x = torch.ones(1, requires_grad=True)
def chain(k=200):
    y = x
    for _ in range(k): y = y * 1.0
    return y
f = best(lambda: chain())[1] / 200
fb = best(lambda: chain().backward())[1] / 200
x2 = torch.ones(1)
def chain0(k=200):
    y = x2
    for _ in range(k): y = y * 1.0
f0 = best(lambda: chain0())[1] / 200
print(f"overhead us: plain {f0*1e6:.2f}, grad fwd {f*1e6:.2f}, bwd {(fb-f)*1e6:.2f}")
print("load", os.getloadavg())
