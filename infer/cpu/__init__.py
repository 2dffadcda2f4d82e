"""The CPU fast path: faster ways to run the target and the draft head that keep their bits, and the one
place that picks which runs (`choose_target`, `choose_draft`; `EagleGenerator` logs the pick as one line).

Each rung is taken only where a probe on this machine gives the rung below's bits (the lean target: the
HF forward's logits), so greedy output does not depend on the rung. Fastest last:

    target (infer/target.py)        draft head (infer/draft.py)
    generic        HF forward       generic    the head's own modules
    lean           lean.py          packed     bf16 linears packed once for oneDNN (packed.py)
    lean+packed    packed.py        scripted   the layer as two TorchScript halves (scripted.py)
    lean+scripted  scripted.py      fused      those halves as one C++ call each (fused.py)
    lean+fused     fused.py

generic runs the HF forward on a DynamicCache with hooks for the aux states, for any family; the lean
rungs need a Llama-shaped family and run on any device, the packed ones on a CPU with oneDNN bf16. Below
fp32 the lean target's verify is exact (exact_attention.py): each verified row rounds like the 1-token
step it replaces. The decode setting `cpu_path: generic` skips every rung.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from infer.cpu.lean import LeanTarget, lean_unsupported

log = logging.getLogger(__name__)

CPU_PATHS = ("auto", "generic")


@dataclass(frozen=True)
class Path:
    """Which rung runs, and why not the next one up (at the top: what the probes found)."""
    name: str
    reason: str

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})"


def climb(start: str, rungs) -> Path:
    """From rung `start`, take each (name, step) in order, step() returning why not or None when taken;
    stop at the first refusal."""
    name = start
    for next_name, step in rungs:
        why = step()
        if why is not None:
            return Path(name, why)
        name = next_name
    return Path(name, f"every probe bit-exact at {torch.backends.cpu.get_cpu_capability()}")


def check(cpu_path: str) -> None:
    if cpu_path not in CPU_PATHS:
        raise ValueError(f"cpu_path: {cpu_path!r} is not one of {CPU_PATHS}")


def choose_target(model, aux_layer_ids: list[int], cpu_path: str = "auto",
                  exact_verify: bool = True) -> tuple[LeanTarget | None, Path]:
    """(the lean target, or None for the HF forward; the path and why). exact_verify: below fp32, verify
    rows as their 1-token steps round (exact_attention.py)."""
    check(cpu_path)
    if cpu_path == "generic":
        return None, Path("generic", "cpu_path: generic")
    why = lean_unsupported(model)
    if why is not None:
        return None, Path("generic", why)
    lean = LeanTarget(model, aux_layer_ids, exact_verify)
    path = climb("lean", [("lean+packed", lean.pack), ("lean+scripted", lean.script),
                          ("lean+fused", lean.fuse)])
    row_wise = lean.plan_verify()
    why = lean.probe()
    if why is not None:
        return None, Path("generic", f"the lean forward's {why}")
    if lean.exact_attention:
        rows = f", {' / '.join(row_wise)} a row at a time" if row_wise else ""
        path = Path(path.name, f"{path.reason}; exact verify{rows}")
    return lean, path


def choose_draft(runner, cpu_path: str = "auto") -> Path:
    """Climb a DraftRunner's rungs (its `pack`, `script` and `fuse`) as far as its probes allow."""
    check(cpu_path)
    if cpu_path == "generic":
        return Path("generic", "cpu_path: generic")
    return climb("generic", [("packed", runner.pack), ("scripted", runner.script), ("fused", runner.fuse)])


def log_paths(target: Path, draft: Path | None) -> str:
    """The one start-up line naming the target's and the draft's paths; logged at INFO and returned."""
    line = f"cpu path: target {target}; " + (f"draft {draft}" if draft is not None else "no draft head")
    log.info(line)
    return line
