"""Build the model side of a simulation once: the meta-device model, its FLOPs, and per tp the
plan's check, analytic schedule and parameters per rank."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

from dtp import models
from dtp.checks.checker import check
from dtp.errors import UsageError
from dtp.lang.parse import load
from dtp.simulate import flops as fl
from dtp.simulate.memory import Shape, params_per_rank
from dtp.simulate.model import Workload, workload


def shape_of(model: nn.Module) -> Shape:
    """Layers, hidden size, heads and vocabulary of a transformer, from its config and structure."""
    cfg = getattr(model, "config", None)
    hidden = getattr(cfg, "n_embd", None) or getattr(cfg, "hidden_size", None)
    heads = getattr(cfg, "n_head", None) or getattr(cfg, "num_attention_heads", None)
    vocab = models.vocab_size(model)
    layers = len(fl.block_paths(model))
    if not (hidden and heads and vocab and layers):
        raise UsageError(
            "dtp simulate needs a transformer whose config gives its hidden size and heads "
            "(n_embd/hidden_size, n_head/num_attention_heads) and a ModuleList of blocks"
        )
    kv = getattr(cfg, "n_kv_head", None) or getattr(cfg, "num_key_value_heads", None) or heads
    ffn = getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or 4 * hidden
    names = {path.rsplit(".", 1)[-1] for path, _ in model.named_modules()}
    gated = bool(names & {"gate_proj", "gate_up_proj", "w1", "w3"})  # SwiGLU's gate matrix
    fused = bool(names & {"c_attn", "qkv_proj", "query_key_value", "Wqkv"})  # one q/k/v matrix
    dropout = (
        any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())
        or float(getattr(cfg, "dropout", 0.0) or 0.0) > 0
    )
    return Shape(
        layers, int(hidden), int(heads), int(vocab), int(kv), int(ffn), gated, fused, dropout
    )


@dataclass
class Prepared:
    """One plan on one model, with workloads cached per (tp, micro-batch, precision)."""

    plan_path: str
    model_spec: str
    seq: int | None  # None: the model's block size (1024 if it has none)
    plan: object = None
    model: nn.Module | None = None
    flops: fl.Flops | None = None
    shape: Shape | None = None
    _cache: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.plan = load(self.plan_path)
        self.model = models.build(models.resolve(self.model_spec), device="meta")
        checked = check(self.plan, self.model, None)  # syntax and model checks, any tp
        self.seq = (
            self.seq or getattr(getattr(self.model, "config", None), "block_size", None) or 1024
        )
        self.shape = shape_of(self.model)
        block = getattr(getattr(self.model, "config", None), "block_size", None)
        if isinstance(block, int) and self.seq > block:
            raise UsageError(f"--seq {self.seq} exceeds {self.model_spec}'s block size {block}")
        try:
            self.flops = fl.count(self.model, self.seq, checked.resolution)
        except Exception as err:  # noqa: BLE001 - a user's model that cannot run on meta tensors: say so, no traceback
            raise UsageError(
                f"{self.model_spec}: its forward pass failed on the meta device "
                f"({type(err).__name__}: {err}); dtp simulate counts FLOPs there"
            ) from None

    def workload(self, tp: int, micro_batch: int, precision: str) -> Workload:
        """The workload at `tp` (a plan that does not fit tp is a positioned plan error, exit 2)."""
        key = (tp, micro_batch, precision)
        if key not in self._cache:
            checked = check(self.plan, self.model, tp)
            per_rank = params_per_rank(self.model, checked.resolution, tp)
            self._cache[key] = workload(
                checked,
                self.model,
                tp,
                seq=self.seq,
                micro_batch=micro_batch,
                precision=precision,
                flops=self.flops,
                params_per_rank=per_rank,
                shape=self.shape,
            )
        return self._cache[key]
