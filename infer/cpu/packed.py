"""Linear layers with their weights packed once for oneDNN (the CPU fast path, infer/cpu/__init__.py).

On a CPU with AMX or AVX512-BF16, `F.linear` on bf16 weights re-lays-out the weight on every call. Packing
it once (the layout inductor's CPU freezing uses) removes that, and the packed kernel's cost is nearly flat
in the row count: a 16-token verify then costs about what a 1-token step does. `PackedLinear.pack` uses a
packed linear only where it gives F.linear's rows bit for bit at 1 and at 16 rows. Whether a row keeps its
bits across row counts is the CPU's GEMM's business, packed or not: `rows_depend_on_count` finds out, and
the lean verify calls such linears one row at a time.

Only bf16 is packed: fp32 weights go through MKL, whose small-row GEMMs are already fast unpacked.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn


class NotPacked(Exception):
    """Why a linear keeps F.linear here (the message is the reason)."""


def packing_unsupported(weight: torch.Tensor) -> str | None:
    """Why `weight` cannot be packed here, or None when it can."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return f"only bf16 weights on CPU are packed, not {weight.dtype} on {weight.device.type}"
    if not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "oneDNN bf16 is not supported on this CPU"
    return None


class PackedLinear(nn.Module):
    """y = x @ W.T + b for the rows of x, with W packed once (a plain attribute: `.to()` leaves it alone,
    and it is not in the state dict). Build with `pack`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, rows_hint: int):
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint)
        self.bias = None if bias is None else bias.detach()
        self.out_features = weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    @classmethod
    def pack(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, rows_hint: int = 16,
             parts: list[nn.Linear] | None = None) -> "PackedLinear":
        """A PackedLinear when packing is supported and gives F.linear's rows bitwise at 1 and 16 rows
        (with `parts`: the separate linears' rows side by side, as a model that calls them gets); else
        raises NotPacked with the reason."""
        why = packing_unsupported(weight)
        if why is None:
            try:
                lin = cls(weight, bias, rows_hint)
                why = lin.check(weight, bias, parts)
            except RuntimeError as e:  # an op missing from this torch build
                why = f"oneDNN packing failed: {str(e).splitlines()[0]}"
        if why is not None:
            raise NotPacked(why)
        return lin

    @classmethod
    def pack_fused(cls, linears: list[nn.Linear]) -> "PackedLinear":
        """One PackedLinear for linears that read the same input (q|k|v, gate|up): their outputs side by
        side, checked against each linear's own rows."""
        weight = torch.cat([m.weight for m in linears], dim=0)
        biases = [m.bias for m in linears]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b if b is not None else weight.new_zeros(m.out_features)
                              for m, b in zip(linears, biases)])
        return cls.pack(weight, bias, parts=linears)

    @torch.no_grad()
    def check(self, weight: torch.Tensor, bias: torch.Tensor | None,
              parts: list[nn.Linear] | None = None) -> str | None:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(1, 16, weight.shape[1], generator=gen).to(weight.dtype)
        if parts is None:
            want = F.linear(x, weight, bias)
        else:
            want = torch.cat([F.linear(x, m.weight, m.bias) for m in parts], dim=-1)
        if not torch.equal(self(x), want):
            return "packed bf16 rows differ from F.linear's on this CPU"
        one = F.linear(x[:, :1], weight, bias) if parts is None else \
            torch.cat([F.linear(x[:, :1], m.weight, m.bias) for m in parts], dim=-1)
        if not torch.equal(self(x[:, :1]), one):  # a 1-token step: the call HF generate makes
            return "packed bf16 1-row calls differ from F.linear's on this CPU"
        return None


@torch.no_grad()
def rows_depend_on_count(linear, in_features: int, like: torch.Tensor, trials: int = 8,
                         rows: int = 16) -> bool:
    """Does a row of a multi-row call of `linear` ever differ from that row's own 1-row call? On a CPU
    without AMX, oneDNN's bf16 GEMM sums a long input (K = 1536 on SmolLM2's down projection, not 576)
    in another order for one row than for several, and a few outputs in 10^4 round the other way: rare
    per call, so `trials` calls of `rows` random rows, every row compared."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(trials):
        x = torch.randn(1, rows, in_features, generator=gen).to(like)
        full = linear(x)
        if any(not torch.equal(full[:, r], linear(x[:, r:r + 1])[:, 0]) for r in range(rows)):
            return True
    return False


def with_packed_linears(module: nn.Module) -> nn.Module:
    """A copy of `module` whose every nn.Linear is a PackedLinear; raises NotPacked (the caller's module
    unchanged) when any of them cannot be packed here."""
    names = [name for name, m in module.named_modules() if isinstance(m, nn.Linear)]
    if not names:
        raise NotPacked("no nn.Linear to pack")
    why = packing_unsupported(module.get_submodule(names[0]).weight)
    if why is not None:
        raise NotPacked(why)
    out = copy.deepcopy(module)
    for name in names:
        lin = out.get_submodule(name)
        parent, _, leaf = name.rpartition(".")
        setattr(out.get_submodule(parent) if parent else out, leaf, PackedLinear.pack(lin.weight, lin.bias))
    return out
