"""`dtp bench --device cuda`: the GPU check, a few minutes on one GPU, results to
`<out>/<YYYYmmdd-HHMMSS>-gpu-<host>/`.

1. `dtp apply` parity on NCCL at tp = min(GPUs, 2) (the real command line, gpt2-tiny);
2. a bf16 (autocast) training step of gpt2-medium at tp 1: step time, tokens/s, model FLOP
   utilisation;
3. dtp ÷ Megatron-style step time on GPU, arms interleaved, parity enforced first (tp = min(GPUs,
   2)): dtp eager and dtp with every block under torch.compile, beside the hand-written plan;
4. `dtp generate` (the real command line) on a Llama `save_pretrained` directory of about 350M
   parameters in bfloat16 (grouped-query, decoding from its KV cache), 64 new tokens at
   tp = min(GPUs, 2): token-exact against the unsharded model, tokens/s and the memory bandwidth it
   reached.

`--dry-run` runs the same logic on CPU with tiny sizes (gloo, gpt2-tiny): what CI can check without
a GPU.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dtp import models
from dtp.bench import scaling
from dtp.bench.arms import PLAN
from dtp.bench.megatron import flops_per_token
from dtp.bench.report import compare, results_folder
from dtp.errors import RunError
from dtp.models import hf

# dense bf16 peak FLOP/s by device name (vendor datasheets); an unknown GPU gets achieved FLOP/s
# only
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}


def _command(out: Path, name: str, args: list[str]) -> tuple[str, int, dict]:
    """`python -m dtp ARGS --json OUT/NAME.json --timeout 240` in a subprocess (the user's path),
    its output in OUT/NAME.log: the command as run (without the interpreter), its exit status and
    its JSON report ({} when it wrote none)."""
    report = out / f"{name}.json"
    cmd = [sys.executable, "-m", "dtp", *args, "--json", str(report), "--timeout", "240"]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    (out / f"{name}.log").write_text(done.stdout + done.stderr)
    return (
        " ".join(cmd[1:]),
        done.returncode,
        json.loads(report.read_text()) if report.exists() else {},
    )


def _apply_parity(out: Path, tp: int, device: str) -> dict:
    """`dtp apply PLAN gpt2-tiny --tp N --device D --json` in a subprocess: the user's path, exit
    status 0."""
    plan = out / "gpt2.tp"
    plan.write_text(PLAN)
    args = ["apply", str(plan), "gpt2-tiny", "--tp", str(tp), "--device", device]
    command, code, report = _command(out, "apply", args)
    parity = report.get("parity", {})
    return {
        "command": command,
        "exit": code,
        "ok": code == 0 and parity.get("ok") is True,
        "tp": tp,
        "backend": "nccl" if device == "cuda" else "gloo",
        "parity": parity,
    }


# the Llama of the decode check: ~350M parameters, 8 key/value heads for 16 query heads
DECODE_LLAMA = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=32000,
    max_position_embeddings=1024,
)


def _generate(out: Path, tp: int, device: str, dry_run: bool) -> dict:
    """`dtp generate hf/llama DIR --tp N --device D --json` in a subprocess on a Llama directory
    this check writes (tiny and float32 in a dry run); exit status 0 and its report's numbers."""
    from transformers import AutoModelForCausalLM  # an optional package: the HF families

    torch.manual_seed(0)
    config = hf.config("llama", **({} if dry_run else DECODE_LLAMA))
    dtype = "float32" if dry_run else "bfloat16"
    directory = out / "llama"
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    parameters = sum(p.numel() for p in model.parameters())
    model.save_pretrained(directory)
    del model
    prompt = " ".join(str(1 + i % 97) for i in range(16 if dry_run else 128))
    args = ["generate", "hf/llama", str(directory), "--tp", str(tp), "--device", device]
    args += [
        "--dtype",
        dtype,
        "--prompt-ids",
        prompt,
        "--max-new-tokens",
        str(4 if dry_run else 64),
    ]
    command, code, report = _command(out, "generate", args)
    keep = ("tokens_per_s", "ms_per_token", "memory_gb_per_s", "weight_bytes_per_rank")
    return {
        "command": command.replace(str(directory), "DIR"),
        "exit": code,
        "ok": code == 0 and report.get("ok") is True,
        "tp": tp,
        "parameters": parameters,
        **{k: report.get(k) for k in keep},
    }


def train_step_mfu(
    model_name: str, device: str, batch: int, seq: int, steps: int = 10, warmup: int = 3
) -> dict:
    """Median bf16-autocast training step (AdamW) of a zoo GPT at tp 1; MFU against the GPU's dense
    bf16 peak."""
    torch.manual_seed(0)
    model = models.build(model_name, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    ids = torch.randint(0, model.config.vocab_size, (batch, seq + 1), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times, losses = [], []
    for i in range(steps + warmup):
        sync()
        t0 = time.perf_counter()
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    step_s = statistics.median(times[warmup:])
    flops = flops_per_token(model.config, seq) * batch * seq / step_s
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    return {
        "model": model_name,
        "device": name,
        "batch": batch,
        "seq": seq,
        "step_ms": step_s * 1e3,
        "tokens_per_s": batch * seq / step_s,
        "achieved_tflops": flops / 1e12,
        "mfu": flops / peak if peak else None,
        "peak_bf16_tflops": peak / 1e12 if peak else None,
        "finite": all(math.isfinite(v) for v in losses),
        "loss_first_last": [losses[0], losses[-1]],
    }


def _ratio_on(cfg: scaling.Config) -> dict:
    """The interleaved benchmark configuration on `cfg.tp` local ranks: spawned NCCL ranks, one GPU
    each, or, on CPU, forked gloo ranks (one thread each, as the CPU benchmark runs); a failed rank
    is a failed result."""
    try:
        return scaling.run(scaling.preflight(cfg))
    # a rank that failed: the check's other results are still written, then exit 1
    except RunError as err:
        return {"config": cfg.to_json(), "ok": False, "error": str(err)}


def main(root: Path, dry_run: bool = False) -> int:
    """Run the three checks; exit 1 when parity failed anywhere, 2 when no GPU is visible (without
    --dry-run)."""
    gpus = torch.cuda.device_count()
    if not dry_run and gpus == 0:
        print(
            "error: dtp bench --device cuda: no CUDA device is visible (use --dry-run to check the "
            "logic on CPU)",
            file=sys.stderr,
        )
        return 2
    device, tp = ("cpu", 2) if dry_run else ("cuda", min(gpus, 2))
    out = results_folder(
        root, "gpu-dry-run" if dry_run else "gpu", datetime.datetime.now(datetime.timezone.utc)
    )
    result: dict = {"device": device, "gpus": gpus, "torch": torch.__version__, "notes": []}
    if tp == 1:
        result["notes"].append(
            "one GPU: parity and the ratio run at tp 1 on NCCL (no tensor-parallel "
            "communication is exercised; rerun on a machine with 2 GPUs for that)"
        )
    t0 = time.monotonic()
    result["apply"] = _apply_parity(out, tp, device)
    if dry_run:
        result["train"] = train_step_mfu("gpt2-tiny", "cpu", batch=2, seq=32, steps=2, warmup=1)
        cfg = scaling.Config(
            n_layer=1,
            n_head=4,
            n_embd=32,
            vocab_size=64,
            seq=8,
            batch=2,
            tp=tp,
            warmup=1,
            samples=3,
            timeout=600,
            arms=("dtp", "hand", "megatron", "dtp-compile"),
        )
    else:
        result["train"] = train_step_mfu("gpt2-medium", "cuda", batch=8, seq=1024)
        cfg = scaling.Config(
            n_layer=8,
            n_head=16,
            n_embd=1024,
            vocab_size=32768,
            seq=1024,
            batch=8,
            tp=tp,
            warmup=3,
            samples=20,
            device="cuda",
            timeout=600,
            arms=("dtp", "hand", "megatron", "dtp-compile"),
        )
    ratio = _ratio_on(cfg)
    result["ratio"] = {
        "config": ratio["config"],
        "ok": ratio["ok"],
        "error": ratio.get("error"),
        "times_ms": ratio.get("times_ms"),
        "parity": ratio.get("parity"),
        **(compare(ratio) if ratio["ok"] else {}),
    }
    result["generate"] = _generate(out, tp, device, dry_run)
    result["seconds"] = time.monotonic() - t0
    (out / "result.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    lines = [
        f"GPU check ({'dry run on CPU' if dry_run else device}, {gpus} GPU(s), torch "
        f"{torch.__version__})",
        f"apply parity ({result['apply']['backend']}, tp={tp}): "
        f"{'OK' if result['apply']['ok'] else 'FAILED'}",
        f"train {result['train']['model']}: {result['train']['step_ms']:.1f} ms/step, "
        f"{result['train']['tokens_per_s']:.0f} tokens/s, {result['train']['achieved_tflops']:.2f} "
        "TFLOP/s"
        + (
            f", MFU {result['train']['mfu']:.1%}"
            if result["train"]["mfu"]
            else ", MFU: unknown peak"
        ),
    ]
    if ratio["ok"]:
        v = result["ratio"]["dtp_vs_megatron"]
        lines.append(
            f"dtp/Megatron-style at tp={tp}: {v['value']:.3f} [{v['low']:.3f}, {v['high']:.3f}] "
            f"({v['verdict']})"
        )
        if "dtp_compile_vs_megatron" in result["ratio"]:
            c = result["ratio"]["dtp_compile_vs_megatron"]
            lines.append(
                f"dtp under torch.compile/Megatron-style at tp={tp}: {c['value']:.3f} "
                f"[{c['low']:.3f}, {c['high']:.3f}] ({c['verdict']})"
            )
    else:
        lines.append(f"ratio: FAILED: {ratio['error']}")
    g = result["generate"]
    lines.append(
        f"generate (Llama, tp={tp}): token-exact {'OK' if g['ok'] else 'FAILED'}"
        + (
            f", {g['tokens_per_s']:.0f} tokens/s, {g['memory_gb_per_s']:.1f} GB/s per GPU"
            if g["ok"]
            else f" (exit {g['exit']}: see generate.log)"
        )
    )
    lines += [f"note: {n}" for n in result["notes"]] + [
        f"written to {out}/ in {result['seconds']:.0f} s"
    ]
    (out / "results.md").write_text("\n\n".join(lines) + "\n")
    print("\n".join(lines))
    passed = result["apply"]["ok"] and ratio["ok"] and result["train"]["finite"] and g["ok"]
    return 0 if passed else 1
