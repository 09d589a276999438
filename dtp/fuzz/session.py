"""`dtp fuzz [PLAN MODEL] [--examples N] [--seed S] [--max-world W] [--save DIR] [--replay CASE]
[--parser]`."""

from __future__ import annotations

import signal
import sys

from tqdm import tqdm

from dtp import models
from dtp.errors import UsageError
from dtp.files import shipped, writable_dir
from dtp.fuzz.cases import mutated_cases, mutated_texts, user_cases, zoo_cases
from dtp.fuzz.pool import Pools
from dtp.fuzz.replay import check_case_memory, load_checked_case
from dtp.fuzz.runner import evaluate, fuzz, fuzz_parser, save
from dtp.lang.parse import read_plan_text
from dtp.runtime.preflight import check_memory, check_world, estimate, model_vocab
from dtp.verify.probes import MAX_PROBE_SEQ

# drawn training lengths; the probes after the steps still reach the model's maximum
FUZZ_MAX_SEQ = 128


def _user_model(spec: str, max_world: int) -> int:
    """The longest sequence to draw for a user's model (its stated maximum, at most FUZZ_MAX_SEQ; 16
    when it states none), after refusing a model whose largest draw would not fit in memory (exit 2,
    nothing forked): tp × dp ≤ max_world ranks, float64, 3 sequences per dp rank, and the probes'
    one long sequence."""
    meta = models.build(models.resolve(spec), device="meta")
    stated = models.max_sequence(meta)
    longest = min(stated or 16, FUZZ_MAX_SEQ)
    vocab = model_vocab(meta, spec)  # as `dtp apply` and `dtp train` refuse a model without one
    dp = 2 if max_world >= 4 else 1
    steps = estimate(meta, max_world // dp, dp, 3 * dp, longest, 8, vocab)
    probe = estimate(
        meta, max_world // dp, dp, 1, min(stated or MAX_PROBE_SEQ, MAX_PROBE_SEQ), 8, vocab
    )
    check_memory(max(steps, probe, key=lambda e: e.total), "cpu")
    return longest


def _fuzz_parser(seeds: list[str], examples: int, seed: int) -> int:
    """Random texts and mutations of `seeds` through the parser: every one a clean plan error or a
    plan."""
    failures = fuzz_parser(mutated_texts(seeds), examples, seed)
    print(f"parser fuzz: {examples} texts, {len(failures)} not a clean plan error")
    for f in failures[:5]:
        print(f"  {f[:300]}")
    return 1 if failures else 0


def _replay(path: str, factory: str | None, timeout: float) -> int:
    """Rerun one saved case; a case is data: every field is checked before any rank starts."""
    case, saved_error = load_checked_case(path, factory)
    check_case_memory(case)
    pools = Pools()
    try:
        print(f"replaying {path}: {case.describe()}")
        if saved_error:
            print(f"  saved with: {saved_error}")
        outcome = evaluate(case, pools, timeout)
        print(f"  now: {outcome.kind}" + (f": {outcome.message}" if outcome.message else ""))
        return 1 if outcome.kind == "failed" else 0
    finally:
        pools.close()


def fuzz_command(
    *,
    plan: str | None = None,
    model: str | None = None,
    examples: int = 100,
    seed: int = 0,
    max_world: int = 4,
    save_to: str | None = None,
    replay: str | None = None,
    factory: str | None = None,
    mutate: bool = False,
    parser: bool = False,
    shrink: bool = True,
    timeout: float = 120.0,
    show_progress: bool = False,
) -> int:
    """`dtp fuzz`: exit 0 when every example held, 1 when one failed (saved under `save_to`), 2 on
    usage errors. PLAN and MODEL draw meshes and shapes for that plan; neither draws plans on zoo
    models (`mutate`: plans with one mistake each); `replay` reruns a saved case (`factory`: the
    model factory it may run); `parser` fuzzes the parser alone; `timeout` is per example."""
    if parser:
        seeds = [p.read_text() for p in sorted(shipped("plans").glob("*.tp"))] or [
            "dtp 1\na: colwise\n"
        ]
        return _fuzz_parser(seeds, examples, seed)
    check_world(max_world, "cpu")
    save_dir = writable_dir(save_to) if save_to else None
    if replay:
        return _replay(replay, factory, timeout)
    if (plan is None) != (model is None):
        raise UsageError(
            "give both PLAN and MODEL, or neither (to fuzz random plans on zoo models)"
        )
    if plan:
        strategy = user_cases(read_plan_text(plan), model, max_world, _user_model(model, max_world))
    else:
        strategy = mutated_cases(max_world) if mutate else zoo_cases(max_world)
    pools = Pools()
    try:
        summary = _draw(
            strategy,
            pools,
            examples=examples,
            seed=seed,
            shrink=shrink,
            timeout=timeout,
            show_progress=show_progress,
        )
        print(f"fuzz: {summary.describe()}")
        if not summary.failure:
            return 0
        case, message = summary.failure
        print(
            f"FAILED (shrunk): {message}\n  {case.describe()}\n  plan:\n"
            + "".join(f"    {line}\n" for line in case.plan.splitlines())
        )
        if save_dir:
            path = save(case, message, save_dir)
            print(f"  saved as {path}; rerun with: dtp fuzz --replay {path}")
        return 1
    finally:
        pools.close()


def _draw(
    strategy,
    pools: Pools,
    *,
    examples: int,
    seed: int,
    shrink: bool,
    timeout: float,
    show_progress: bool,
):
    """The fuzz run (dtp.fuzz.runner.fuzz) behind a progress bar, Ctrl-C stopping it between
    examples."""
    bar = tqdm(
        total=examples,
        unit="ex",
        desc="fuzz",
        disable=not sys.stderr.isatty() and not show_progress,
    )
    interrupted = []

    def interrupt(signum, frame) -> None:
        interrupted.append(signum)

    # Ctrl-C is remembered, and raised where the example ends (progress). Raised in the handler it
    # lands wherever Python runs next: inside a torch dispatch rule called from C++ it cannot
    # unwind and the process aborts with a C++ stack; inside a finalizer it is swallowed. Ranks
    # ignore SIGINT, and every example has a timeout, so the wait is bounded.
    previous = signal.signal(signal.SIGINT, interrupt)

    def progress(outcome) -> None:
        if interrupted:
            raise KeyboardInterrupt
        bar.update(1)
        bar.set_postfix_str(outcome.kind)

    try:
        summary = fuzz(
            strategy, examples, seed, pools, shrink=shrink, progress=progress, timeout=timeout
        )
    finally:
        signal.signal(signal.SIGINT, previous)
        bar.close()
    if interrupted:  # the last example ended after the Ctrl-C
        raise KeyboardInterrupt
    return summary
