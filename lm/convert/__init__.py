"""`lm convert --from FORMAT SRC --output DIR` / `lm convert --to FORMAT SRC --output DIR`: checkpoints of
other projects in and out. Formats: fla (flash-linear-attention's gated_deltaproduct <-> lm_deltaproduct, and its
hybrids with attention layers <-> lm_hybrid; lm/convert/fla.py)."""
from __future__ import annotations

import argparse
import sys

FORMATS = ("fla",)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lm convert", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    way = ap.add_mutually_exclusive_group(required=True)
    way.add_argument("--from", dest="src_format", choices=FORMATS,
                     help="SRC is a checkpoint of this format (fla: a gated_deltaproduct folder, with or without "
                          "attention layers); write an lm folder")
    way.add_argument("--to", dest="dst_format", choices=FORMATS,
                     help="SRC is an lm folder, run or checkpoint folder; write this format")
    ap.add_argument("src", help="the folder to convert")
    ap.add_argument("--output", "-o", required=True, help="new folder to write (must not exist or be empty)")
    args = ap.parse_args(argv)
    from . import fla

    try:
        if args.src_format:
            out, dropped = fla.from_fla(args.src, args.output)
        else:
            out, dropped = fla.to_fla(args.src, args.output)
    except (ValueError, FileNotFoundError) as e:
        print(f"lm convert: {e}", file=sys.stderr)
        return 2
    if args.src_format:
        import json

        kind = json.loads((out / "config.json").read_text())["model_type"]
    else:
        kind = "fla gated_deltaproduct"
    print(f"wrote {kind} model to {out}")
    if dropped:
        print(f"dropped fields that steer only kernels, losses or initialisation: {', '.join(dropped)}")
    return 0
