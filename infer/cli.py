"""eagleray STAGE CONFIG.yaml [key=value ...]: one command for the four stages.

Each stage is the same code as its `python -m` module (listed below), which keeps working, so a
`ray job submit -- python -m trainer ...` and a `ray job submit -- eagleray train ...` run alike. The stage's
module is imported only when it is asked for: `eagleray --help` starts no Ray and loads no torch.
"""
from __future__ import annotations

import importlib
import sys

# stage -> (module with main(argv), what it does)
STAGES = {
    "pipeline": ("pipeline.__main__", "ingest, regenerate, tokenize, capture hidden states, draft vocabulary"),
    "train": ("trainer.__main__", "train the EAGLE-3 head on Ray Train + DeepSpeed, export it"),
    "eval": ("infer.eval", "acceptance length and speedup per benchmark, report.md and plots"),
    "serve": ("infer.serve", "OpenAI-compatible speculative decoding on Ray Serve"),
}


def usage() -> str:
    rows = "\n".join(f"  {name:<9} {what}  (python -m {mod.removesuffix('.__main__')})"
                     for name, (mod, what) in STAGES.items())
    return (f"usage: eagleray STAGE CONFIG.yaml [key=value ...] [--verbose]\n\nstages:\n{rows}\n\n"
            "`eagleray STAGE --help` gives a stage's own options; configs/ holds an example YAML per stage.")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    stage, rest = argv[0], argv[1:]
    if stage not in STAGES:
        print(f"eagleray: unknown stage {stage!r}; choose one of {', '.join(STAGES)}", file=sys.stderr)
        return 2
    importlib.import_module(STAGES[stage][0]).main(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
