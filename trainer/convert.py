"""Convert a head between the SGLang and the vLLM speculators formats (or rewrite it in the current export).

    eagleray convert-head SRC_DIR --target TARGET_DIR --format speculators --out OUT_DIR

Reads either format, checks every tensor name and shape, and writes config.json + model.safetensors with
the aux layer ids spelled out in the destination's numbering. The target folder gives the layer count
(for heads that rely on the default layer rule) and the verifier name written into speculators configs.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from pipeline.target import TargetSpec
from trainer.export import FORMATS, convert_head


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--format", choices=FORMATS, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    out, aux = convert_head(args.src, TargetSpec.read(args.target), args.out, args.format)
    print(json.dumps({"src": str(args.src), "out": str(out), "format": args.format, "aux_layer_ids": aux}))
    return out


if __name__ == "__main__":
    main()
