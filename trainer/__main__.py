"""python -m trainer CONFIG.yaml [key=value ...]

Trains an EAGLE-3 head on a capture folder with Ray Train + DeepSpeed, resuming from the latest
checkpoint in out_dir when there is one, then exports the best head (SGLang and speculators formats).
"""
from __future__ import annotations

import argparse
import json
import sys

from pipeline.cluster import ensure_ray  # noqa: F401  (sets the Ray env defaults before ray is imported)
from pipeline.config import load_or_exit
from trainer.config import TrainConfig


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m trainer", description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="dotted key=value, e.g. optim.lr=3e-4")
    args = ap.parse_args(argv)
    cfg = load_or_exit(TrainConfig, args.config, args.overrides)
    from trainer.driver import run_training

    try:
        report = run_training(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"trainer error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    except Exception as e:  # Ray wraps worker errors; show the root cause in one line
        root = e
        while getattr(root, "__cause__", None) is not None:
            root = root.__cause__
        print(f"trainer error: {type(root).__name__}: {root}", file=sys.stderr)
        raise SystemExit(1) from None
    print(json.dumps({k: report[k] for k in ("steps", "wall_s", "last_acc", "best", "exports")}))
    return report


if __name__ == "__main__":
    main()
