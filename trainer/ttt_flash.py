"""TTT attention on PyTorch's CPU flash-attention kernel (ARCHITECTURE.md §5, "TTT attention kernels").

Step s's queries see the step-0 keys causally plus their own position's keys from steps 1..s (the
diagonal; see trainer/ttt.py). The causal block is the flash kernel's `is_causal` case, which never builds
the [B, h, T, T] score matrix; the s diagonal scores are one dot product per position. The two are merged
through the log-sum-exp the kernel returns:

    L = logaddexp(lse_causal, logsumexp_j d_j),   out = exp(lse_causal - L) * o_causal + sum_j exp(d_j - L) v_j

Backward: the kernel's backward recomputes P = exp(S - lse) and D = rowsum(grad * out) from the `out` and
`lse` it is handed. Handed the merged out and L it therefore yields the exact gradients of the causal block
inside the full softmax; the diagonal terms add dS_j = p_j (grad . v_j - D) by hand. On a SmolLM2-shaped
step (2 x 1000 tokens, 9 heads, TTT 7, one thread) the attention forward + backward goes from 2.9 s
(blocked, materialised) to 0.8 s, and the memory traffic that made two workers contend goes with it.
`trainer.ttt.ttt_attention` stays the reference (and the path on other devices); tests compare both with
the dense mask, gradients included.
"""
from __future__ import annotations

import torch

_FWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def flash_available(q: torch.Tensor) -> bool:
    """The kernel exists in this torch build and runs on q's device and dtype."""
    return (_FWD is not None and _BWD is not None and q.device.type == "cpu"
            and q.dtype in (torch.float32, torch.float64, torch.bfloat16))


class _TTTFlash(torch.autograd.Function):
    """apply(q, k0, v0, k1..ks, v1..vs) -> out [B, h, T, d]; every input [B, h, T, d], heads expanded."""

    @staticmethod
    def forward(ctx, q, k0, v0, *diag):
        s = len(diag) // 2
        scale = q.shape[-1] ** -0.5
        out, lse = _FWD(q, k0, v0, 0.0, True, scale=scale)
        p = None
        if s:
            wide = torch.promote_types(q.dtype, torch.float32)  # merge in >= fp32 (lse is fp32 for bf16)
            d = torch.stack([(q * k).sum(-1, dtype=wide) for k in diag[:s]], dim=-1) * scale  # [B, h, T, s]
            lse_causal = lse.to(wide)
            total = torch.logaddexp(lse_causal, torch.logsumexp(d, dim=-1))
            p = torch.exp(d - total.unsqueeze(-1))
            merged = torch.exp(lse_causal - total).unsqueeze(-1) * out
            for j, v in enumerate(diag[s:]):
                merged = merged + p[..., j:j + 1] * v
            out, lse = merged.to(q.dtype), total.to(lse.dtype)
        ctx.save_for_backward(q, k0, v0, out, lse, p, *diag)
        ctx.s, ctx.scale = s, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k0, v0, out, lse, p, *diag = ctx.saved_tensors
        s, scale = ctx.s, ctx.scale
        grad = grad.contiguous()
        gq, gk0, gv0 = _BWD(grad, q, k0, v0, out, lse, 0.0, True, scale=scale)
        if not s:
            return gq, gk0, gv0
        keys, values = diag[:s], diag[s:]
        dot_out = (grad * out).sum(-1, dtype=p.dtype)  # D: the softmax backward's row term
        gq = gq.to(p.dtype)
        gks, gvs = [], []
        for j in range(s):
            ds = p[..., j] * ((grad * values[j]).sum(-1, dtype=p.dtype) - dot_out) * scale  # [B, h, T]
            gq = gq + ds.unsqueeze(-1) * keys[j]
            gks.append((ds.unsqueeze(-1) * q).to(keys[j].dtype))
            gvs.append((p[..., j:j + 1] * grad).to(values[j].dtype))
        return (gq.to(q.dtype), gk0, gv0, *gks, *gvs)


def ttt_attention_flash(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Same contract as `trainer.ttt.ttt_attention` without the causal bias (the kernel's own causal rule):
    q [B, h, T, d]; keys / values one [B, h, T, d] per step 0..s."""
    return _TTTFlash.apply(q, keys[0], values[0], *keys[1:], *values[1:])
