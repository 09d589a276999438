"""`dtp simulate`: the command line of the simulator, as keyword calls (dtp/cli/simulate.py passes
the flags)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from dtp.errors import UsageError
from dtp.simulate import profile, sweep
from dtp.simulate.calibrate import profile_yaml
from dtp.simulate.cli_reproduce import reproduce_command
from dtp.simulate.model import Run, simulate
from dtp.simulate.prepare import Prepared
from dtp.simulate.report import render, write_output


def simulate_command(
    *,
    plan: str | None = None,
    model: str | None = None,
    profile_name: str | None = None,
    tp: int = 1,
    dp: int = 1,
    micro_batch: int = 8,
    global_batch: int | None = None,
    seq: int | None = None,
    precision: str = "fp16",
    recompute: str = "full",
    optimizer: str = "adam",
    dp_overlap: bool | None = None,
    fsdp: bool = False,
    tp_overlap: bool = False,
    torch_compile: bool = False,
    attention: str | None = None,
    reproduce: str | None = None,
    sweep_paper: bool = False,
    json_path: str | None = None,
    plot: str | None = None,
    markdown: str | None = None,
    calibrate: bool = False,
    output: str | None = None,
) -> int:
    """`dtp simulate PLAN MODEL --profile P [...]`, `--sweep`, `--reproduce SOURCE` or `--calibrate
    -o PROFILE`: the exit status. `profile_name` is --profile (a shipped profile or a YAML file),
    `sweep_paper` --sweep, `json_path` --json, `torch_compile` --compile. None means: `global_batch`
    micro_batch × dp, `seq` the model's block size, `dp_overlap` the profile's, `attention` flash
    (unfused for the sweep)."""
    if calibrate:
        return _calibrate(output)
    if reproduce:
        if plan or model or sweep_paper or plot:
            raise UsageError(
                "--reproduce SOURCE takes no PLAN, MODEL, --sweep or --plot: each row brings its "
                "own"
            )
        return reproduce_command(reproduce, markdown=markdown, json_path=json_path)
    if not (plan and model and profile_name):
        raise UsageError(
            "dtp simulate needs PLAN, MODEL and --profile (or --calibrate -o PROFILE, or "
            "--reproduce SOURCE)"
        )
    if (plot or markdown) and not sweep_paper:
        raise UsageError(
            "--plot and --markdown write the --sweep (or --reproduce) tables; add --sweep"
        )
    if fsdp and dp_overlap is False:
        raise UsageError(
            "--fsdp always overlaps its collectives with compute; drop --no-dp-overlap"
        )
    prof = profile.load(profile_name)
    if sweep_paper:
        return _sweep(
            plan,
            model,
            prof,
            precision=precision,
            recompute=recompute,
            dp_overlap=dp_overlap,
            attention=attention or "unfused",
            json_path=json_path,
            plot=plot,
            markdown=markdown,
        )
    start = time.perf_counter()
    global_batch = global_batch or micro_batch * dp
    if global_batch % (micro_batch * dp):
        raise UsageError(
            f"--global-batch {global_batch} is not a multiple of --micro-batch × --dp = "
            f"{micro_batch * dp}"
        )
    prepared = Prepared(plan, model, seq)
    run = Run(
        tp,
        dp,
        micro_batch,
        global_batch,
        prepared.seq,
        precision,
        recompute,
        optimizer,
        prof.dp_overlap if dp_overlap is None else dp_overlap,
        fsdp=fsdp,
        compile=torch_compile,
        attention=attention or "flash",
        tp_overlap=tp_overlap,
    )
    result = simulate(prepared.workload(tp, micro_batch, precision), run, prof)
    print(render(result, prepared, prof, time.perf_counter() - start))
    if json_path:
        write_output(
            json_path,
            json.dumps(
                {"profile": prof.name, "model": model, "plan": plan, **result.to_json()}, indent=2
            )
            + "\n",
        )
    return 0


def _sweep(
    plan: str,
    model: str,
    prof,
    *,
    precision: str,
    recompute: str,
    dp_overlap: bool | None,
    attention: str,
    json_path: str | None,
    plot: str | None,
    markdown: str | None,
) -> int:
    """The paper's weak-scaling experiment and `model`'s strong scaling: the tables, and the files
    asked for."""
    rows = sweep.paper_sweep(plan, model, prof, precision, recompute, dp_overlap, attention)
    text = sweep.markdown(rows, prof)
    print(text, end="")
    if markdown:
        write_output(markdown, text)
    if json_path:
        write_output(
            json_path,
            json.dumps(
                {
                    "profile": prof.name,
                    "plan": plan,
                    "efficiency": "flop",
                    "rows": [r.to_json() for r in rows],
                },
                indent=2,
            )
            + "\n",
        )
    if plot:
        try:
            sweep.plot(rows, plot)
        except ImportError:
            raise UsageError("--plot needs matplotlib (pip install matplotlib)") from None
    return 0


def _calibrate(output: str | None) -> int:
    """Measure this machine and write its profile to `output`."""
    if not output:
        raise UsageError("--calibrate writes a profile: give -o PROFILE.yaml")
    name = Path(output).name.rsplit(".", 1)[0] or "this-machine"
    text, raw = profile_yaml(name)
    profile.parse(text, output)  # what we write must load
    write_output(output, text)
    print(text, end="")
    print(f"wrote {output}")
    return 0
