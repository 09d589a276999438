"""`dtp fuzz --replay CASE`: a saved case is data. Every field is checked before any rank starts,
and a `module:factory` named by a case runs only when the user names the same factory on the command
line."""

from __future__ import annotations

from pathlib import Path

import yaml

from dtp import files, models
from dtp.errors import UsageError, clip, shorten
from dtp.fuzz.cases import Case
from dtp.runtime.preflight import check_memory, check_world, estimate

# a case holds one plan (≤ 4 MiB is what `dtp check` reads) and a few numbers
MAX_CASE_BYTES = 4 * 2**20
DTYPES = ("float32", "bfloat16", "float64")
# the preflight bounds them further
_LIMITS = {"tp": 64, "dp": 64, "batch": 4096, "seq": 65536, "seed": 2**63 - 2**16}


def _read(path: str) -> dict:
    p = Path(path)
    if not p.exists():
        raise UsageError(
            f"cannot replay {clip(path, 200)}: not a saved dtp fuzz case (no such file)"
        )
    try:  # the one bounded loader (dtp/files.py): regular files, size before reading, depth ≤ 32
        data = files.load_json(p, "case", MAX_CASE_BYTES)
    except UsageError as err:
        raise UsageError(
            f"cannot replay {clip(path, 200)}: not a saved dtp fuzz case ({err})"
        ) from None
    if not isinstance(data, dict):
        raise UsageError(
            f"cannot replay {path}: not a saved dtp fuzz case (a JSON {type(data).__name__}, not an "
            "object)"
        )
    return data


def _int_field(path: str, data: dict, key: str, low: int, default: int | None) -> int:
    value = data.get(key, default)
    if value is None:
        raise UsageError(f"cannot replay {path}: not a saved dtp fuzz case (missing field '{key}')")
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= _LIMITS[key]:
        raise UsageError(
            f"case {path}: '{key}' must be an integer from {low} to {_LIMITS[key]}, got "
            f"{shorten(value)}"
        )
    return value


def _model(path: str, model: object, allow_factory: str | None) -> object:
    if isinstance(model, dict):
        models.config_from_dict(f"in case {path}", model)  # typed and bounded, as a YAML config
        return model
    if not isinstance(model, str) or not model:
        raise UsageError(
            f"case {path}: 'model' must be a model config object or a MODEL string, got "
            f"{shorten(model)}"
        )
    if model in models.zoo_names():
        return model
    if model.endswith((".yaml", ".yml")):
        models.resolve(model)  # read as data, checked
        return model
    if ":" in model:
        if model != allow_factory:
            raise UsageError(
                f"case {path} names the model factory {shorten(model)}, which would import and run "
                f"code; to run it, name it yourself: dtp fuzz --replay {path} --factory "
                f"{model[:200]}"
            )
        return model
    raise UsageError(f"case {path}: unknown model {shorten(model)}")


def load_checked_case(path: str, allow_factory: str | None = None):
    """(Case, the error it was saved with) from a case file whose every field has been checked."""
    data = _read(path)
    plan = data.get("plan")
    if not isinstance(plan, str):
        raise UsageError(f"case {path}: 'plan' must be the plan's text, got {shorten(plan)}")
    if len(plan.encode("utf-8", "replace")) > MAX_CASE_BYTES:
        raise UsageError(f"case {path}: the plan is larger than {MAX_CASE_BYTES // 2**20} MiB")
    tp = _int_field(path, data, "tp", 1, None)
    dp = _int_field(path, data, "dp", 1, 1)
    batch = _int_field(path, data, "batch", 1, 2)
    seq = _int_field(path, data, "seq", 1, 8)
    seed = _int_field(path, data, "seed", 0, 0)
    if batch % dp:
        raise UsageError(f"case {path}: batch {batch} must divide by dp {dp}")
    dtype = data.get("dtype", "float32")
    if dtype not in DTYPES:
        raise UsageError(
            f"case {path}: 'dtype' must be one of {', '.join(DTYPES)}, got {shorten(dtype)}"
        )
    meta = data.get("meta", {})
    if not isinstance(meta, dict):
        raise UsageError(f"case {path}: 'meta' must be an object, got {shorten(meta)}")
    error = data.get("error", "")
    check_world(tp * dp, "cpu")
    model = _model(path, data.get("model"), allow_factory)
    case = Case(
        plan=plan,
        model=model,
        tp=tp,
        dp=dp,
        batch=batch,
        seq=seq,
        seed=seed,
        dtype=dtype,
        meta=meta,
    )
    return case, error if isinstance(error, str) else shorten(error, 300)


def check_case_memory(case) -> None:
    """Refuse a case whose run would not fit in this machine's memory (the same estimate as `dtp
    apply`)."""
    if isinstance(case.model, dict):
        family, config = models.config_from_dict("case", case.model)
        source = models.ModelSource(yaml.safe_dump(case.model), family, config)
    else:
        source = models.resolve(case.model)
    model = models.build(source, device="meta")
    elem = {"float32": 4, "bfloat16": 2, "float64": 8}[case.dtype]
    check_memory(
        estimate(model, case.tp, case.dp, case.batch, case.seq, elem, models.vocab_size(model)),
        "cpu",
    )
