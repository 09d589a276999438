"""`dtp fuzz [PLAN MODEL] [--examples N] [--seed S] [--max-world W] [--save DIR] [--replay CASE] [--parser]`."""
from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from dtp.errors import UsageError
from dtp.files import writable_dir

FUZZ_MAX_SEQ = 128  # drawn training lengths; the probes after the steps still reach the model's maximum

def _user_model(spec: str, max_world: int) -> int:
    """The longest sequence to draw for a user's model (its stated maximum, at most FUZZ_MAX_SEQ; 16 when it
    states none), after refusing a model whose largest draw would not fit in memory (exit 2, nothing forked):
    tp × dp ≤ max_world ranks, float64, 3 sequences per dp rank, and the probes' one long sequence."""
    from dtp import models
    from dtp.runtime.preflight import check_memory, estimate
    from dtp.verify.probes import MAX_PROBE_SEQ

    meta = models.build(models.resolve(spec), device="meta")
    stated = models.max_sequence(meta)
    longest = min(stated or 16, FUZZ_MAX_SEQ)
    vocab = models.vocab_size(meta)
    dp = 2 if max_world >= 4 else 1
    steps = estimate(meta, max_world // dp, dp, 3 * dp, longest, 8, vocab)
    probe = estimate(meta, max_world // dp, dp, 1, min(stated or MAX_PROBE_SEQ, MAX_PROBE_SEQ), 8, vocab)
    check_memory(max(steps, probe, key=lambda e: e.total), "cpu")
    return longest


def fuzz_command(args: argparse.Namespace) -> int:
    """Exit 0 when every example held, 1 when one failed (saved under --save), 2 on usage errors."""
    from tqdm import tqdm

    from dtp.fuzz.cases import mutated_cases, mutated_texts, user_cases, zoo_cases
    from dtp.fuzz.pool import Pools
    from dtp.fuzz.replay import check_case_memory, load_checked_case
    from dtp.fuzz.runner import evaluate, fuzz, fuzz_parser, save
    from dtp.lang.parse import read_plan_text
    from dtp.runtime.preflight import check_world

    if args.parser:
        seeds = [p.read_text() for p in sorted(Path("plans").glob("*.tp"))] or ["dtp 1\na: colwise\n"]
        failures = fuzz_parser(mutated_texts(seeds), args.examples, args.seed)
        print(f"parser fuzz: {args.examples} texts, {len(failures)} not a clean plan error")
        for f in failures[:5]:
            print(f"  {f[:300]}")
        return 1 if failures else 0

    check_world(args.max_world, "cpu")
    save_dir = writable_dir(args.save) if args.save else None
    case = None
    if args.replay:  # a case is data: every field checked before any rank starts
        case, saved_error = load_checked_case(args.replay, args.factory)
        check_case_memory(case)
    pools = Pools()
    try:
        if case is not None:
            print(f"replaying {args.replay}: {case.describe()}")
            if saved_error:
                print(f"  saved with: {saved_error}")
            outcome = evaluate(case, pools, args.timeout)
            print(f"  now: {outcome.kind}" + (f": {outcome.message}" if outcome.message else ""))
            return 1 if outcome.kind == "failed" else 0

        if (args.plan is None) != (args.model is None):
            raise UsageError("give both PLAN and MODEL, or neither (to fuzz random plans on zoo models)")
        if args.plan:
            text = read_plan_text(args.plan)
            strategy = user_cases(text, args.model, args.max_world, _user_model(args.model, args.max_world))
        else:
            strategy = mutated_cases(args.max_world) if args.mutate else zoo_cases(args.max_world)
        bar = tqdm(total=args.examples, unit="ex", desc="fuzz", disable=not sys.stderr.isatty() and not args.progress)

        interrupted = []

        def interrupt(signum, frame) -> None:
            interrupted.append(signum)
            raise KeyboardInterrupt

        # Ctrl-C is remembered as well as raised: one that lands in a finalizer is swallowed there ("Exception
        # ignored in …") and the fuzz would run on; the next example's end raises it again.
        signal.signal(signal.SIGINT, interrupt)
        sys.unraisablehook = lambda u: None if isinstance(u.exc_value, KeyboardInterrupt) else sys.__unraisablehook__(u)

        def progress(outcome) -> None:
            if interrupted:
                raise KeyboardInterrupt
            bar.update(1)
            bar.set_postfix_str(outcome.kind)

        summary = fuzz(strategy, args.examples, args.seed, pools, shrink=not args.no_shrink, progress=progress,
                       timeout=args.timeout)
        bar.close()
        print(f"fuzz: {summary.describe()}")
        if summary.failure:
            case, message = summary.failure
            print(f"FAILED (shrunk): {message}\n  {case.describe()}\n  plan:\n" +
                  "".join(f"    {line}\n" for line in case.plan.splitlines()))
            if save_dir:
                path = save(case, message, save_dir)
                print(f"  saved as {path}; rerun with: dtp fuzz --replay {path}")
            return 1
        return 0
    finally:
        sys.unraisablehook = sys.__unraisablehook__
        pools.close()
