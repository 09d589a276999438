"""`dtp apply`'s decode probe: a model with a KV cache (Hugging Face's protocol) is run as
`dtp generate` runs it — left-padded prompts, then tokens one at a time from its cache — and each
step's logits compared; a model wrong only there fails at the first decode step."""

from __future__ import annotations

from fixtures.decode_paths import PLAN

from dtp.verify.apply import launch_apply
from dtp.verify.rank import RunConfig

DECODE = "tests.fixtures.decode_paths"
LABEL = "eval, 2×16, left-padded, then 4 tokens from the KV cache"


def _parity(tmp_path, factory: str) -> dict:
    path = tmp_path / "plan.tp"
    path.write_text(PLAN)
    return launch_apply(RunConfig(plan=str(path), model=f"{DECODE}:{factory}", tp=2)).parity


def test_a_model_wrong_only_when_decoding_from_its_cache_fails_there(tmp_path, repo):
    parity = _parity(tmp_path, "cache_wrong")
    failing = {
        q for q in ("logits", "loss", "grads", "params", "buffers", "probes") if not parity[q]["ok"]
    }
    assert failing == {"probes"}  # the steps, the prefill and every other probe agree
    assert parity["probes"]["worst"] == f"logits ({LABEL}: decode step 1)"
    assert parity["probes"]["margin"] > 100  # measured 1.5e4


def test_the_control_decodes_within_its_bounds_and_the_probe_is_stated(tmp_path, repo):
    parity = _parity(tmp_path, "decodes")
    assert parity["ok"] and f"{LABEL}: logits" in parity["shapes"]
    assert parity["probes"]["margin"] < 1
