"""Does `LocalParams` (dtp/compiler/local_params.py, the Megatron layers' one reach past DTensor's
public API) still pay? The same GPT training step at tp 2 with the layers reading their parameters
through leaves, and through DTensor's `to_local()`, in interleaved rounds on real gloo ranks; the
median ratio with its bootstrap interval (dtp.bench.stats). A lab script, not part of the package:
`python bench/local_params_ab.py [--n-embd 256] [--rounds 150]` from a checkout with dtp installed."""

from __future__ import annotations

import argparse
import time

import torch

from dtp.bench.stats import interleaved_orders, median_ratio
from dtp.checks.checker import check
from dtp.compiler.compiler import compile_plan
from dtp.files import shipped
from dtp.lang.parse import load
from dtp.models.gpt import GPT, GPTConfig
from dtp.runtime.mesh import make_mesh
from dtp.runtime.ranks import on_ranks
from dtp.runtime.shard import Program


def _model(n_embd: int) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=4, n_head=4, n_embd=n_embd, vocab_size=2048, block_size=128))


def _arm(rank: int, world: int, n_embd: int, rounds: int) -> dict[str, list[float]]:
    mesh = make_mesh(world, 1)
    plan = load(str(shipped("plans/gpt2.tp")))
    arms = {}
    for name, leaves in (("leaves", True), ("to_local", False)):
        model = _model(n_embd)
        checked = check(plan, model, world)
        program = Program(
            checked, compile_plan(checked, model, mesh, fsdp_follows=not leaves), mesh
        )
        applied = program.apply(model, mesh)
        arms[name] = (model, applied, torch.optim.AdamW(model.parameters(), lr=1e-4))
    ids = torch.randint(0, 2048, (4, 129), generator=torch.Generator().manual_seed(1))
    times: dict[str, list[float]] = {name: [] for name in arms}
    warmup = 5
    for r, order in enumerate(interleaved_orders(tuple(arms), rounds + warmup, warmup=warmup)):
        for name in order:
            model, applied, opt = arms[name]
            start = time.perf_counter()
            applied.loss(model(ids[:, :-1]), ids[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
            if r >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    """Print the median step time of each arm and leaves ÷ to_local with its interval."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=150)
    args = parser.parse_args()
    times = on_ranks(_arm, 2, args.n_embd, args.rounds, timeout=3600)[0]
    ratio = median_ratio(times["leaves"], times["to_local"])
    for name, ts in times.items():
        print(f"{name}: median {sorted(ts)[len(ts) // 2] * 1e3:.2f} ms over {len(ts)} steps")
    print(f"leaves ÷ to_local: {ratio}")


if __name__ == "__main__":
    main()
