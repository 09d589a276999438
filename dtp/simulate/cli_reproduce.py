"""`dtp simulate --reproduce SOURCE`: each published row of a source, predicted, with its error."""

from __future__ import annotations

import json

from dtp.errors import UsageError
from dtp.files import shipped
from dtp.simulate import consistency, reproduce, sweep
from dtp.simulate.profile import load
from dtp.simulate.report import write_output


def reproduce_command(
    name: str, *, markdown: str | None = None, json_path: str | None = None
) -> int:
    """Print (and write to `markdown` and `json_path`) predicted vs published for source `name`, or
    for `all`."""
    names = list(reproduce.NAMES) if name == "all" else [name]
    if name != "all" and name not in reproduce.NAMES:
        raise UsageError(
            f"--reproduce: unknown source '{name[:60]}' (sources: {', '.join(reproduce.NAMES)}, "
            "all)"
        )
    texts, data = [], {}
    for one in names:
        if one == "megatron2019":  # the paper's own experiment, as --sweep runs it
            # the package's plan, from any directory
            prof, plan = load("dgx2h-v100"), str(shipped("plans/gpt2.tp"))
            prepared = sweep.prepare(plan, "megatron-1.2b")
            rows = sweep.paper_sweep(plan, "megatron-1.2b", prof, prepared=prepared)
            traces = consistency.markdown(
                consistency.strong_fit(plan, prof, prepared),
                consistency.data_parallel(plan, prof, prepared),
            )
            texts.append(
                "## megatron2019: Shoeybi et al. 2019, Fig. 5 and Table "
                f"8\n\n{sweep.markdown(rows, prof)}\n"
                f"{traces}"
            )
            data[one] = [r.to_json() for r in rows]
            continue
        src = reproduce.source(one)
        outcomes = reproduce.predict(src)
        texts.append(f"## {one}\n\n{reproduce.markdown(src, outcomes)}")
        data[one] = [
            {
                "label": o.row.label,
                "model": o.row.model,
                "plan": o.row.plan,
                "published": o.row.published,
                "published_s": o.row.published_s,
                "published_GiB": o.row.published_GiB,
                "fitted": o.row.fitted,
                "error": o.error,
                "simulation": o.result.to_json(),
            }
            for o in outcomes
        ]
    text = "\n".join(texts)
    print(text, end="")
    if markdown:
        write_output(markdown, text)
    if json_path:
        write_output(json_path, json.dumps(data, indent=2) + "\n")
    return 0
