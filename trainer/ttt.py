"""Training-time test (ARCHITECTURE.md §5) as pure functions: shifts, attention masks, positions, loss, tau.

Step s, position i: the draft element pairs the feature standing in for target position i + s with the
embedding of token i + 1 + s, is rotated at RoPE position i + s, and learns the target distribution at
position i + 1 + s (the prediction of token i + 2 + s), counted where token i + 2 + s is a loss token.
It attends to step-0 keys 0..i (causal) and to its own position's keys from steps 1..s (the diagonal).
"""
from __future__ import annotations

import torch
from torch import nn


def _wide(x: torch.Tensor) -> torch.Tensor:
    """Softmax-style reductions run in at least fp32 (bf16/fp16 inputs are widened, fp64 kept)."""
    return x.float() if x.dtype in (torch.bfloat16, torch.float16) else x


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, n:] padded at the end with `fill` to the same length (dim 1)."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1) if n < x.shape[1] else torch.full_like(x, fill)


def ttt_positions(seq_len: int, step: int) -> torch.Tensor:
    """RoPE positions of step `step`'s queries (and keys): i + step."""
    return torch.arange(seq_len) + step


def ttt_attention_mask(seq_len: int, step: int) -> torch.Tensor:
    """Dense boolean mask [T, T * (step + 1)] of what step `step`'s queries see, keys ordered step 0
    (positions 0..T-1), then step 1, ... step `step`. Reference for the blocked implementation."""
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    diag = torch.eye(seq_len, dtype=torch.bool)
    return torch.cat([causal] + [diag] * step, dim=1)


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                  causal_bias: torch.Tensor) -> torch.Tensor:
    """Blocked TTT attention. q [B, h, T, d]; keys/values: one [B, h, T, d] per step 0..s (already
    expanded to h heads); causal_bias [T, T] additive (0 / -inf). Equals softmax over the dense mask of
    `ttt_attention_mask` without building a [T, T*(s+1)] matrix."""
    scale = q.shape[-1] ** -0.5
    scores = [torch.matmul(q, keys[0].transpose(-1, -2)) * scale + causal_bias]
    scores += [(q * k).sum(-1, keepdim=True) * scale for k in keys[1:]]
    probs = torch.softmax(_wide(torch.cat(scores, dim=-1)), dim=-1).to(q.dtype)
    t = q.shape[2]
    out = torch.matmul(probs[..., :t], values[0])
    for j, v in enumerate(values[1:]):
        out = out + probs[..., t + j: t + j + 1] * v
    return out


def target_distribution(target_logits: torch.Tensor, t2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Target logits over the full vocab -> (p over the draft vocab, renormalised; target argmax id)."""
    return torch.softmax(_wide(target_logits[..., t2d]), dim=-1), target_logits.argmax(-1)


def step_loss(draft_logits: torch.Tensor, target_p: torch.Tensor, position_mask: torch.Tensor) -> torch.Tensor:
    """-sum_v mask * p * log_softmax(draft), averaged over all B*T positions (ARCHITECTURE.md §5)."""
    logp = torch.log_softmax(_wide(draft_logits), dim=-1)
    return -(position_mask.unsqueeze(-1) * target_p * logp).sum(-1).mean()


def step_correct(draft_logits: torch.Tensor, d2t: torch.Tensor, target_argmax: torch.Tensor) -> torch.Tensor:
    """Per position: draft argmax mapped to target ids equals the target's argmax."""
    draft_ids = draft_logits.argmax(-1)
    return (draft_ids + d2t[draft_ids]) == target_argmax


def simulated_tau(step_acc: list[float]) -> float:
    """Chain acceptance length from per-step accuracies: 1 + a0 + a0*a1 + ... (the bonus token is
    always there; step s is reached only if steps 0..s-1 were accepted)."""
    tau, run = 1.0, 1.0
    for a in step_acc:
        run *= a
        tau += run
    return tau


class StepSums:
    """Per-TTT-step sums of the objective's outputs in one flat tensor (so ranks all-reduce it in one call):
    loss x weight, correct, counted for each step, then total weight and tokens."""

    def __init__(self, ttt_length: int):
        self.L = ttt_length
        self.t = torch.zeros(3 * ttt_length + 2)

    def add(self, out: dict, weight: float = 1.0, tokens: int = 0) -> None:
        L = self.L
        self.t[:L] += out["step_loss"].detach().float().cpu() * weight
        self.t[L:2 * L] += out["step_correct"].detach().cpu()
        self.t[2 * L:3 * L] += out["step_count"].detach().cpu()
        self.t[3 * L] += weight
        self.t[3 * L + 1] += tokens

    def metrics(self, t: torch.Tensor | None = None) -> dict:
        """Mean loss and accuracy per step and the simulated tau, from these sums or reduced ones `t`."""
        L, t = self.L, self.t if t is None else t
        acc = (t[L:2 * L] / t[2 * L:3 * L].clamp(min=1)).tolist()
        return {"loss": (t[:L] / t[3 * L].clamp(min=1e-9)).tolist(), "acc": acc, "sim_tau": simulated_tau(acc),
                "tokens": float(t[3 * L + 1])}


def step_weights(ttt_length: int, decay: float) -> list[float]:
    return [decay ** s for s in range(ttt_length)]


def ttt_unroll(head, aux: torch.Tensor, emb: torch.Tensor, ttt_length: int):
    """The TTT steps of an Eagle3Head over a padded batch (index rules above): yields step s's logits
    [B, T, Vd] for s = 0 .. ttt_length-1. aux [B,T,3Ht]; emb [B,T,H], embeddings of input_ids."""
    b, t, _ = emb.shape
    h = head.fc(aux)
    causal = torch.full((t, t), float("-inf"), device=emb.device, dtype=h.dtype).triu(1)
    attn_mod = head.midlayer.self_attn
    keys, values = [], []
    for s in range(ttt_length):
        pos = (torch.arange(t, device=emb.device) + s).unsqueeze(0).expand(b, t)
        q, k, v = head.qkv(h, shift_left(emb, 1 + s), pos)
        keys.append(attn_mod.expand(k))
        values.append(attn_mod.expand(v))
        x = head.finish(h, ttt_attention(q, keys, values, causal))
        yield head.logits(x)
        h = x


class TTTObjective(nn.Module):
    """The training objective around a head (what the DeepSpeed engine wraps): forward = the weighted TTT
    loss plus per-step metrics. Parameters are the head's under the `head.` prefix."""

    def __init__(self, head: nn.Module, ttt_length: int, decay: float):
        super().__init__()
        self.head, self.ttt_length, self.weights = head, ttt_length, step_weights(ttt_length, decay)
        self._register_load_state_dict_pre_hook(_add_head_prefix)

    def forward(self, aux: torch.Tensor, emb: torch.Tensor, target_p: torch.Tensor, target_argmax: torch.Tensor,
                loss_mask: torch.Tensor) -> dict:
        """target_p [B,T,Vd] and target_argmax [B,T] at each position, loss_mask [B,T]."""
        total = aux.new_zeros((), dtype=torch.float32)
        losses, correct, counted = [], [], []
        for s, logits in enumerate(ttt_unroll(self.head, aux, emb, self.ttt_length)):
            tgt_am = shift_left(target_argmax, 1 + s)
            lm = shift_left(loss_mask, 2 + s).to(logits.dtype)
            pm = lm * self.head.t2d[tgt_am].to(logits.dtype)
            loss = step_loss(logits, shift_left(target_p, 1 + s), pm)
            total = total + self.weights[s] * loss
            losses.append(loss.detach())
            with torch.no_grad():
                ok = step_correct(logits, self.head.d2t, tgt_am) & lm.bool()
                correct.append(ok.sum())
                counted.append(lm.sum())
        return {"loss": total, "step_loss": torch.stack(losses), "step_correct": torch.stack(correct).float(),
                "step_count": torch.stack(counted).float()}


def _add_head_prefix(state: dict, prefix: str, *_args) -> None:
    """Checkpoints written before the objective existed hold the head's names bare: read them as `head.*`."""
    for k in [k for k in state if k.startswith(prefix) and not k.startswith(prefix + "head.")]:
        state[prefix + "head." + k[len(prefix):]] = state.pop(k)
