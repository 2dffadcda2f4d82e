"""TTT attention on PyTorch's flash-attention kernels, CPU and CUDA (ARCHITECTURE.md §6,
"Attention").

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
On CUDA the same merge runs on the FlashAttention-2 kernel (`_scaled_dot_product_flash_attention`: bf16 /
fp16, head dim <= 256, sm80 or newer), which keeps a Llama-3.1-8B-shaped step's [B, h, T, T] fp32 scores
out of memory.
`trainer.ttt.ttt_attention` stays the reference (and the path elsewhere); tests compare both with the
dense mask, gradients included.
"""
from __future__ import annotations

import torch

_CPU_FWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
_CUDA_FWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention", None)
_CUDA_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_backward", None)


def flash_available(x: torch.Tensor, head_dim: int | None = None) -> bool:
    """The kernel exists in this torch build and runs on x's device and dtype at head_dim (default: x's
    last dim, as for q [B, h, T, d])."""
    d = x.shape[-1] if head_dim is None else head_dim
    if x.device.type == "cpu":
        return _CPU_FWD is not None and _CPU_BWD is not None and x.dtype in (torch.float32, torch.float64,
                                                                              torch.bfloat16)
    if x.device.type == "cuda":
        return (_CUDA_FWD is not None and _CUDA_BWD is not None and x.dtype in (torch.bfloat16, torch.float16)
                and d <= 256 and d % 8 == 0 and torch.cuda.get_device_capability(x.device) >= (8, 0))
    return False


def causal_forward(q, k, v, scale: float):
    """The device's flash kernel, causal: (out [B, h, T, d], lse [B, h, T] fp32 (unpadded on both devices,
    torch 2.11 CUDA and 2.13 CPU), what its backward needs besides q, k, v, out and lse)."""
    if q.device.type == "cuda":
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = _CUDA_FWD(q, k, v, 0.0, True, False, scale=scale)
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)
    out, lse = _CPU_FWD(q, k, v, 0.0, True, scale=scale)
    return out, lse, None


def causal_backward(grad, q, k, v, out, lse, state, scale: float):
    """(grad_q, grad_k, grad_v) of `causal_forward`, recomputed from the `out` and `lse` handed in."""
    if state is None:
        return _CPU_BWD(grad, q, k, v, out, lse, 0.0, True, scale=scale)
    cum_q, cum_k, max_q, max_k, seed, offset = state
    return _CUDA_BWD(grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset, scale=scale)


class _TTTFlash(torch.autograd.Function):
    """apply(q, k0, v0, k1..ks, v1..vs) -> out [B, h, T, d]; every input [B, h, T, d], heads expanded."""

    @staticmethod
    def forward(ctx, q, k0, v0, *diag):
        s = len(diag) // 2
        scale = q.shape[-1] ** -0.5
        out, lse, ctx.state = causal_forward(q, k0, v0, scale)
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
        gq, gk0, gv0 = causal_backward(grad, q, k0, v0, out, lse, ctx.state, scale)
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
