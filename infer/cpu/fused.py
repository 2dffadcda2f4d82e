"""The packed Llama-shaped layer's halves, and the draft head's, as one C++ call each (docs/ARCHITECTURE.md
"Fused layer").

The TorchScript halves (infer/cpu/scripted.py) still run ~40 ATen kernels a layer between the linears:
RMSNorm's eight, the rotation's seven, the K/V copies, SiLU, the residual adds, and the views around them,
each paying ATen's dispatch and allocation.
`csrc/fused_layer.cpp` runs those as plain loops that round where PyTorch's kernels round, and calls
the same packed linears. It is built on first use with torch's C++ extension loader (cached under
~/.cache/torch_extensions) for the vector width torch's own CPU kernels run at here, and `LeanTarget` and
`DraftRunner` use it only where it gives the TorchScript halves' bits on a probe; else those stay.
`EAGLERAY_FUSED_LAYER=0` turns it off.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "fused_layer.cpp"
# The vector width decides the order PyTorch's sum kernel adds in: build for the one torch runs at.
CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY=AVX512",
               "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
}


@functools.cache
def extension():
    """(the built extension, None), or (None, why not) where it is off, unsupported or fails to build."""
    if os.environ.get("EAGLERAY_FUSED_LAYER", "1") == "0":
        return None, "EAGLERAY_FUSED_LAYER=0"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in CAPABILITY_FLAGS:
        return None, f"no fused layer for torch's {capability} CPU kernels"
    try:
        from torch.utils.cpp_extension import load
        flags = ["-O2", "-ffp-contract=off", *CAPABILITY_FLAGS[capability]]
        ext = load(f"eagleray_fused_layer_{capability.lower()}", [str(SOURCE)], extra_cflags=flags,
                   verbose=False)
    except Exception as err:  # noqa: BLE001 - no compiler or headers here: the TorchScript halves stay
        return None, f"the fused layer did not build: {str(err).splitlines()[0][:200]}"
    return ext, None
