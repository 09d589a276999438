import time, torch, torch.nn.functional as F
torch.set_num_threads(1)
flush = torch.empty(1 << 24)  # 64 MB
def t(fn, cold, reps=9):
    fn(); ts = []
    for _ in range(reps):
        if cold: flush.add_(1.0)
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return min(ts), sorted(ts)[len(ts)//2]
for (m, k, n) in ((1024, 256, 768), (1024, 256, 4096), (1024, 1024, 256), (1024, 512, 2048)):
    x, w, b = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
    fl = 2*m*k*n
    for cold in (False, True):
        best, med = t(lambda: torch.addmm(b, x, w.t()), cold)
        print(m, k, n, "cold" if cold else "hot ", f"best {fl/best/1e9:.0f} med {fl/med/1e9:.0f} GF/s")
a = torch.randn(1024, 4096)
for cold in (False, True):
    best, med = t(lambda: F.log_softmax(a, -1), cold)
    print("log_softmax 4M", "cold" if cold else "hot ", f"{best*1e3:.2f} {med*1e3:.2f} ms")
a = torch.randn(1 << 20)
for cold in (False, True):
    best, med = t(lambda: F.gelu(a, approximate="tanh"), cold)
    print("gelu.tanh 1M", "cold" if cold else "hot ", f"{best*1e3:.2f} {med*1e3:.2f} ms")
