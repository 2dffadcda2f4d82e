"""A packed Llama-shaped decoder layer, and the draft head's one layer, each in two TorchScript halves
around its attention (the "scripted" rung of the CPU fast path, infer/cpu/__init__.py).

On a small target most of a decode step that is not the weights' matmuls is per-op overhead: ~35 tiny
kernels a layer (RMSNorm alone is 8), each paying Python dispatch. TorchScript runs the same ATen ops in the
same order, so the bits are the modules' (`LeanTarget` and `DraftRunner` check them on a probe and fall
back otherwise), with the Python side of every op gone. The attention stays in Python between the halves:
its exact verify groups rows in ways a script would only repeat (infer/cpu/exact_attention.py).

The ops mirror transformers' modules: `LlamaRMSNorm` (fp32 statistics, cast back, then the weight), the
rotation `x * cos + rotate_half(x) * sin`, and the MLP `down(silu(gate) * up)`; the draft's mirror
trainer/head.py (its RMSNorm casts back before the weight too, in another order).
"""
from __future__ import annotations

import warnings
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F


def script(fn):
    """`fn` in TorchScript, or `fn` itself (the same ops, eager) where this torch cannot script it, or
    where TorchScript's CPU fuser is on (fused ops round differently). torch 2.13 marks `torch.jit.script`
    deprecated; `torch.compile` is no substitute here, since it too fuses the ops."""
    if torch._C._jit_can_fuse_on_cpu():
        return fn
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return torch.jit.script(fn)
    except Exception:  # noqa: BLE001 - a torch without TorchScript, or one that rejects this source
        return fn


@script
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, op for op."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype)


@script
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x @ W.T + b with W packed by `torch.ops.mkldnn._reorder_linear_weight` (infer/cpu/packed.py)."""
    no_scalars: List[Optional[number]] = []  # noqa: F821 - TorchScript's `number` type
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", no_scalars, "")


@script
def linear_rows(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor],
                per_row: bool) -> torch.Tensor:
    """packed_linear of x [1, n, K]; per_row: one 1-row call per row, for a linear whose rows round
    differently in a multi-row call (infer/cpu/packed.rows_depend_on_count)."""
    if not per_row or x.shape[1] == 1:
        return packed_linear(x, packed, bias)
    outs: List[torch.Tensor] = []
    for i in range(x.shape[1]):
        outs.append(packed_linear(x[:, i:i + 1], packed, bias))
    return torch.cat(outs, dim=1)


@script
def rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotation `x * cos + rotate_half(x) * sin`, op for op (so bit for bit), on x [1, n, heads, D]
    with cos, sin [1, n, 1, D]: q and k heads side by side in one pass."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@script
def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The draft head's RMSNorm (trainer/head.py), op for op: cast back, then the weight."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


@script
def qkv_rows(out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
             head_dim: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A packed q|k|v output [1, n, (heads + 2 kv_heads) D] -> q [1, heads, n, D], k, v [1, kv_heads, n, D],
    q and k rotated together (cos, sin [1, n, 1, D])."""
    n = out.shape[1]
    nqk = (heads + kv_heads) * head_dim
    qk = rope_rows(out[..., :nqk].view(1, n, heads + kv_heads, head_dim), cos, sin)
    v = out[..., nqk:].view(1, n, kv_heads, head_dim).transpose(1, 2)
    return qk[:, :, :heads].transpose(1, 2), qk[:, :, heads:].transpose(1, 2), v


@script
def attention_inputs(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, qkv: torch.Tensor,
                     qkv_bias: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, heads: int,
                     kv_heads: int, head_dim: int,
                     per_row: List[bool]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [1, n, H] -> q [1, heads, n, D], k, v [1, kv_heads, n, D]: input norm, packed q|k|v, q and k
    rotated together (cos, sin [1, n, 1, D]). per_row: [qkv, o, gate_up, down] called a row at a time."""
    out = linear_rows(rms_norm(x, norm_weight, eps), qkv, qkv_bias, per_row[0])
    return qkv_rows(out, cos, sin, heads, kv_heads, head_dim)


@script
def output_and_mlp(x: torch.Tensor, attn: torch.Tensor, o: torch.Tensor, o_bias: Optional[torch.Tensor],
                   norm_weight: torch.Tensor, eps: float, gate_up: torch.Tensor,
                   gate_up_bias: Optional[torch.Tensor], down: torch.Tensor,
                   down_bias: Optional[torch.Tensor], per_row: List[bool]) -> torch.Tensor:
    """The rest of the layer: x + o(attn), then + down(silu(gate) * up) of its post-attention norm."""
    x = x + linear_rows(attn, o, o_bias, per_row[1])
    gate, up = linear_rows(rms_norm(x, norm_weight, eps), gate_up, gate_up_bias, per_row[2]).chunk(2, dim=-1)
    return x + linear_rows(F.silu(gate) * up, down, down_bias, per_row[3])


@script
def draft_inputs(h: torch.Tensor, emb: torch.Tensor, input_norm: torch.Tensor, hidden_norm: torch.Tensor,
                 eps: float, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                 kv_heads: int, head_dim: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The draft head's `qkv` (trainer/head.py): [norm(emb), norm(h)] -> packed q|k|v -> rotated q, k, v."""
    x = torch.cat([head_rms_norm(emb, input_norm, eps), head_rms_norm(h, hidden_norm, eps)], dim=-1)
    return qkv_rows(packed_linear(x, qkv, None), cos, sin, heads, kv_heads, head_dim)


@script
def draft_outputs(h: torch.Tensor, attn: torch.Tensor, o: torch.Tensor, post_norm: torch.Tensor, eps: float,
                  gate_up: torch.Tensor, down: torch.Tensor, final_norm: torch.Tensor, lm_head: torch.Tensor,
                  last_only: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """The draft head's `finish` and `logits`: attn [1, heads, m, D] -> (pre-norm outputs [1, m, H],
    draft logits [1, m, Vd], or [1, 1, Vd] for the last element when last_only)."""
    t = attn.shape[2]
    x = h + packed_linear(attn.transpose(1, 2).reshape(1, t, -1), o, None)
    gate, up = packed_linear(head_rms_norm(x, post_norm, eps), gate_up, None).chunk(2, dim=-1)
    x = x + packed_linear(F.silu(gate) * up, down, None)
    y = x[:, -1:] if last_only else x
    return x, packed_linear(head_rms_norm(y, final_norm, eps), lm_head, None)
