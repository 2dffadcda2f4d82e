"""The packed Llama-shaped layer's halves, and the draft head's, as one C++ call each (docs/ARCHITECTURE.md
"Fused layer").

The TorchScript halves (infer/scripted_layer.py) still run ~40 ATen kernels a layer between the linears:
RMSNorm's eight, the rotation's seven, the K/V copies, SiLU, the residual adds, and the views around them,
each paying ATen's dispatch and allocation (~7 ms of a 25 ms SmolLM2 step on a 2-core CPU).
`infer/csrc/fused_layer.cpp` runs those as plain loops that round where PyTorch's kernels round, and calls
the same packed linears. It is built on first use with torch's C++ extension loader (~30 s, cached under
~/.cache/torch_extensions) for the vector width torch's own CPU kernels run at here, and `LeanTarget` and
`DraftRunner` use it only where it gives the TorchScript halves' bits on a probe; else those stay.
`EAGLERAY_FUSED_LAYER=0` turns it off.
"""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "fused_layer.cpp"
# The vector width decides the order PyTorch's sum kernel adds in: build for the one torch runs at.
CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY=AVX512",
               "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
}


@functools.cache
def module():
    """The built extension, or None (the reason logged) where it is off, unsupported or fails to build."""
    if os.environ.get("EAGLERAY_FUSED_LAYER", "1") == "0":
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in CAPABILITY_FLAGS:
        log.info("fused layer off: torch runs its CPU kernels at %s", capability)
        return None
    try:
        from torch.utils.cpp_extension import load
        flags = ["-O2", "-ffp-contract=off", *CAPABILITY_FLAGS[capability]]
        return load(f"eagleray_fused_layer_{capability.lower()}", [str(SOURCE)], extra_cflags=flags, verbose=False)
    except Exception as err:  # noqa: BLE001 - no compiler or headers here: the TorchScript halves stay
        log.warning("fused layer off: the extension did not build (%s)", str(err).splitlines()[0][:200])
        return None
