"""`dtp train PLAN MODEL`: exit 0 trained (and, with --compare-tp, the curves agree); 1 a rank
failed, the loss or the tp ranks' replicas diverged, or the curves differ; 2 a plan, data or flag
error (before any rank starts); 130 interrupted."""

from __future__ import annotations

import argparse
import sys

from dtp.cli.args import (
    bounded,
    memory_size,
    positive_int,
    seed_int,
    stall_seconds,
    timeout_seconds,
    tp_list,
)
from dtp.errors import UsageError
from dtp.files import writable_dir, writable_file
from dtp.runtime.job import DP_MODES, RECOMPUTE, TRAIN_PRECISIONS

# steps: far beyond any run, so a typo is an error rather than a silent "never"
MAX_INTERVAL = 10**9
interval = bounded(MAX_INTERVAL, low=0)  # 0, or a number of steps


def add_parser(sub) -> None:
    """Register `dtp train`."""
    t = sub.add_parser(
        "train",
        help="train a sharded model on real text; --compare-tp for convergence parity",
        # its flags are many: an error's usage line stays one line (`dtp train -h` lists them)
        usage="%(prog)s PLAN MODEL [--tp N] [--dp M] [options]",
    )
    t.add_argument("plan")
    t.add_argument(
        "model", help="zoo name, model YAML, package.module:factory, or a save_pretrained directory"
    )
    t.add_argument("--tp", type=positive_int, default=2, help="tensor-parallel size (default 2)")
    t.add_argument(
        "--dp", type=positive_int, default=1, help="data-parallel size; --batch is global"
    )
    t.add_argument(
        "--dp-mode",
        choices=DP_MODES,
        default="fsdp",
        help="fsdp (default): FSDP2 shards parameters, gradients and AdamW state over dp; ddp: "
        "replicated, gradients all-reduced",
    )
    t.add_argument(
        "--data",
        help="a text file, a directory of text files, or a .bin of uint16 token ids "
        "(default: the Python standard library's source, 2 MiB)",
    )
    t.add_argument(
        "--tokenizer",
        choices=("bytes", "bpe"),
        default="bytes",
        help="byte-level ids (default) or a BPE trained on the corpus to the model's vocabulary",
    )
    t.add_argument("--steps", type=positive_int, default=300)
    t.add_argument(
        "--batch", type=positive_int, default=8, help="global batch in sequences (default 8)"
    )
    t.add_argument(
        "--micro-batch",
        type=positive_int,
        metavar="B",
        help="sequences per micro-batch on each dp rank: the gradient accumulates over "
        "--batch / (dp × B) of them (default: the whole --batch / dp at once)",
    )
    t.add_argument("--seq", type=positive_int, default=64, help="tokens per sequence (default 64)")
    t.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    t.add_argument(
        "--min-lr",
        type=float,
        default=3e-4,
        help="learning rate at the end of the cosine (default 3e-4)",
    )
    t.add_argument("--warmup", type=int, help="linear warm-up steps (default: 10%% of --steps)")
    t.add_argument(
        "--weight-decay", type=float, default=0.1, help="AdamW decay on matrices (default 0.1)"
    )
    t.add_argument(
        "--clip",
        type=float,
        default=1.0,
        help="global gradient-norm clip, 0 for none (default 1.0)",
    )
    t.add_argument(
        "--precision",
        choices=tuple(TRAIN_PRECISIONS),
        help="fp32 (default); bf16 or fp16: autocast forward over float32 master weights and AdamW "
        "state, fp16 with dynamic loss scaling",
    )
    t.add_argument(
        "--dtype", choices=tuple(TRAIN_PRECISIONS.values()), help="the same as --precision"
    )
    t.add_argument(
        "--eval-every",
        type=positive_int,
        default=50,
        help="validation every E steps and at the end",
    )
    t.add_argument(
        "--recompute",
        choices=RECOMPUTE,
        help="what backward recomputes: none (default); full: each block's forward; selective: "
        "the attention core; op: all but every other matmul, attention and collectives",
    )
    t.add_argument(
        "--checkpoint-activations",
        action="store_true",
        help="the same as --recompute full",
    )
    t.add_argument("--seed", type=seed_int, default=0)
    t.add_argument(
        "--init",
        choices=("model", "keyed"),
        default="model",
        help="model (default): the model's own initialisation for --seed, built whole on rank 0 and "
        "scattered (rank 0's host must hold the whole model); keyed: GPT-2's init (normal matrices, "
        "unit "
        "norms, zero biases) drawn by each rank for its own shards only, for models too large for "
        "one "
        "host (it refuses other 1-D parameters)",
    )
    t.add_argument(
        "--check-replicas",
        type=interval,
        default=10,
        metavar="N",
        help="compare the tp ranks' copies of replicated tensors after the first step, every N steps, "
        "before each checkpoint and at the end (0: checkpoints and the end only; default 10); "
        "a divergence stops the run, exit 1",
    )
    t.add_argument(
        "--verify-every",
        type=interval,
        default=100,
        metavar="N",
        help="every N steps and after the last, compare the sharded model's logits and loss on a "
        "fixed batch with a float64 replay of its own weights on rank 0 (0: off; default 100); "
        "a difference beyond the step's own rounding stops the run, exit 1",
    )
    t.add_argument(
        "--max-rank-memory",
        type=memory_size,
        metavar="BYTES",
        help="refuse a tp whose per-rank parameters + gradients + AdamW state exceed BYTES (e.g. 1.5MiB)",
    )
    t.add_argument(
        "--profile",
        metavar="P",
        help="the hardware profile of this machine (shipped name or YAML; `dtp simulate --calibrate "
        "-o this.yaml` measures one): the summary sets `dtp simulate`'s prediction for this layout, "
        "step time included, beside what was measured",
    )
    t.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    t.add_argument(
        "--threads",
        type=positive_int,
        metavar="N",
        help="intra-op threads per rank (default: "
        "OMP_NUM_THREADS if set, else the cores divided among the ranks)",
    )
    t.add_argument(
        "--timeout",
        type=timeout_seconds,
        default=900.0,
        help="seconds before every rank is stopped (default 900)",
    )
    t.add_argument(
        "--stall-timeout",
        type=stall_seconds,
        default=100.0,
        metavar="SEC",
        help="end the run when no rank has made progress for SEC seconds, naming the rank and "
        "step (default 100; 0: only --timeout)",
    )
    t.add_argument(
        "--out", default="dtp-train", help="directory for metrics.jsonl, summary.json, loss.png"
    )
    t.add_argument("--json", metavar="PATH", help="also write the summary as JSON")
    t.add_argument(
        "--compare-tp",
        type=tp_list,
        metavar="1,2,4",
        help="train at each tp from the same init on the same batches; overlay and tabulate",
    )
    t.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="save a checkpoint (DCP, reshardable) here at the end and every --save-every steps",
    )
    t.add_argument(
        "--save-every",
        type=positive_int,
        metavar="N",
        help="save every N steps (needs --checkpoint)",
    )
    t.add_argument(
        "--resume",
        metavar="DIR",
        help="continue from this checkpoint's step to --steps, at any --tp/--dp",
    )
    t.add_argument(
        "--fresh",
        action="store_true",
        help="start over even when --checkpoint DIR holds a checkpoint (without it, a run whose "
        "--checkpoint DIR holds one of this plan and model continues from its step: how a restarted "
        "or pre-empted run resumes by itself)",
    )
    t.add_argument(
        "--convert",
        action="store_true",
        help="with --resume: accept a checkpoint of another plan "
        "and re-cut its tensors for this one",
    )
    t.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Train (or compare tps) and print the summary."""
    from dtp.train.loop import TrainConfig
    from dtp.train.session import train_command

    # outputs proven usable before the model is built or any rank starts: never a file where a
    # directory belongs, a device, a FIFO or /proc; nothing is created yet
    writable_dir(args.out, "--out", create=False)
    if args.checkpoint:
        writable_dir(args.checkpoint, "--checkpoint", create=False)
    json_path = writable_file(args.json, "--json") if args.json else None
    cfg = TrainConfig(
        plan=args.plan,
        model=args.model,
        tp=args.tp,
        dp=args.dp,
        batch=args.batch,
        seq=args.seq,
        seed=args.seed,
        dtype=_dtype(args),
        device=args.device,
        timeout=args.timeout,
        steps=args.steps,
        lr=args.lr,
        min_lr=args.min_lr,
        warmup=args.warmup,
        weight_decay=args.weight_decay,
        clip=args.clip,
        eval_every=args.eval_every,
        recompute=_recompute(args),
        micro_batch=args.micro_batch,
        dp_mode=args.dp_mode,
        profile=args.profile,
        out=args.out,
        progress=sys.stderr.isatty(),
        checkpoint=args.checkpoint,
        save_every=args.save_every or 0,
        resume=args.resume,
        convert=args.convert,
        fresh=args.fresh,
        init=args.init,
        check_replicas=args.check_replicas,
        verify_every=args.verify_every,
        threads=args.threads,
        stall_timeout=args.stall_timeout,
    )
    return train_command(
        cfg,
        data_path=args.data,
        tokenizer=args.tokenizer,
        compare_tp=args.compare_tp,
        max_rank_memory=args.max_rank_memory,
        json_path=json_path,
    )


def _dtype(args: argparse.Namespace) -> str:
    """--precision or its older name --dtype (one of them, or agreeing); float32 by default."""
    named = TRAIN_PRECISIONS.get(args.precision) if args.precision else None
    if named and args.dtype and named != args.dtype:
        raise UsageError(f"--precision {args.precision} and --dtype {args.dtype} disagree")
    return named or args.dtype or "float32"


def _recompute(args: argparse.Namespace) -> str:
    """--recompute, or --checkpoint-activations (= full); none by default."""
    if args.checkpoint_activations and args.recompute not in (None, "full"):
        raise UsageError(
            f"--checkpoint-activations is --recompute full; it contradicts --recompute "
            f"{args.recompute}"
        )
    return args.recompute or ("full" if args.checkpoint_activations else "none")
