"""`expertcache quantize MODEL_DIR OUT_DIR --experts FORMAT`."""

from __future__ import annotations

import argparse


def add_quantize_subcommand(sub) -> None:
    p = sub.add_parser("quantize", help="write a copy of a checkpoint with its routed experts quantized")
    p.add_argument("model", help="input Hugging Face model directory")
    p.add_argument("out", help="output directory")
    p.add_argument(
        "--experts",
        required=True,
        choices=["fp8", "fp8-channel", "int8", "int4", "mxfp4", "bf16"],
        help="expert format: fp8 (128x128 block scales), fp8-channel, int8 / int4 (group-wise "
        "round-to-nearest; int8 symmetric, int4 asymmetric), mxfp4 (OCP MX)",
    )
    p.add_argument(
        "--group-size", type=int, default=None, help="int8/int4 group size along the input dim (default 128)"
    )
    p.add_argument("--block-size", type=int, default=None, help="fp8 block size (default 128)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from .rewrite import quantize_checkpoint

    out = quantize_checkpoint(
        args.model, args.out, args.experts, args.group_size, args.block_size, progress=True
    )
    print(f"wrote {out}")
    return 0
