"""Training-time test (ARCHITECTURE.md §6) as pure functions: shifts, attention masks, positions, loss, tau.

Step s, position i: the draft element pairs the feature standing in for target position i + s with the
embedding of token i + 1 + s, is rotated at RoPE position i + s, and learns the target distribution at
position i + 1 + s (the prediction of token i + 2 + s), counted where token i + 2 + s is a loss token.
It attends to step-0 keys 0..i (causal) and to its own position's keys from steps 1..s (the diagonal).
"""
from __future__ import annotations

import torch
from torch import nn

from trainer.ttt_flash import flash_available, ttt_attention_flash


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
    # One split, not a slice per block: each slice's backward zero-fills a whole [B, h, T, T + s] gradient
    # (measured 15% of a SmolLM2-shaped step); split's backward is one cat of the pieces.
    blocks = probs.split([q.shape[2]] + [1] * (len(values) - 1), dim=-1)
    out = torch.matmul(blocks[0], values[0])
    for p, v in zip(blocks[1:], values[1:]):
        out = out + p * v
    return out


def target_rows(loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which target positions any TTT step reads, and their row in the compact target table.

    Step s at position i reads target position j = i + 1 + s and counts it iff token j + 1 is a loss
    token, so position j is needed iff loss_mask[j + 1] (whatever s). Returns (need [B, T] bool,
    row [B, T] long: the row of j in a table of the needed positions in row-major order, -1 elsewhere)."""
    need = shift_left(loss_mask, 1).bool()
    row = torch.full(need.shape, -1, dtype=torch.long, device=need.device)
    row[need] = torch.arange(int(need.sum()), device=need.device)
    return need, row


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim (first maximal index, as argmax): `max(-1).indices` is the same answer in
    half the time of CPU `argmax` on [rows, vocab] (measured 20 vs 10 ms on [1100, 8192], one thread)."""
    return x.max(-1).indices


def target_distribution(target_logits: torch.Tensor, t2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Target logits over the full vocab -> (p over the draft vocab, renormalised; target argmax id).
    The argmax needs every vocab row (is it in the draft vocab at all?), so the full lm_head stays."""
    return torch.softmax(_wide(target_logits[..., t2d]), dim=-1), row_argmax(target_logits)


def step_loss(draft_logits: torch.Tensor, target_p: torch.Tensor, weight: torch.Tensor, positions: int) -> torch.Tensor:
    """-sum_rows weight * sum_v p * log_softmax(draft) / positions (ARCHITECTURE.md §6): rows are the
    counted positions only; dividing by all B*T positions keeps the dense formula's scale."""
    return position_losses(draft_logits, target_p, weight, confidence=False)[0].sum() / positions


def position_losses(draft_logits: torch.Tensor, target_p: torch.Tensor, weight: torch.Tensor, hard: bool = False,
                    confidence: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per counted row: (weight x cross-entropy against the target's distribution over the draft vocab, or
    with hard=True against its argmax alone (speculators' DFlash `ce`); the draft's probability of that
    argmax, detached: the row's chance of acceptance, which D-PACE weighs by; None without `confidence`,
    which skips the argmax on the soft loss's hot path)."""
    logp = torch.log_softmax(_wide(draft_logits), dim=-1)
    if not (hard or confidence):
        return weight * -(target_p * logp).sum(-1), None
    lp_top = logp.gather(-1, row_argmax(target_p)[:, None]).squeeze(-1)
    ce = -lp_top if hard else -(target_p * logp).sum(-1)
    return weight * ce, lp_top.detach().exp()


LK_DECAY = 3.0  # lk_hybrid's lambda = exp(-LK_DECAY * alpha): the LK paper's best hybrid setting


def acceptance_rate(draft_logits: torch.Tensor, target_p: torch.Tensor) -> torch.Tensor:
    """Per row: sum_v min(p_v, q_v), q = softmax(draft logits): the chance that speculative sampling accepts
    a token drawn from q against p (1 - their total variation distance), over the draft vocabulary."""
    return overlap(torch.softmax(_wide(draft_logits), dim=-1), _wide(target_p))


def overlap(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """sum_v min(q_v, p_v) per row."""
    return torch.minimum(q, p).sum(-1)


def lk_losses(kind: str, draft_logits: torch.Tensor, target_p: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per counted row, weight x the LK loss (arXiv 2602.23881), alpha the row's `acceptance_rate`:
      lk_hybrid: lam * KL(p || q) + (1 - lam) * (1 - alpha), lam = exp(-3 alpha) held constant in the backward
                 pass: KL's strong gradient while the draft is far off, acceptance itself once it is close;
      lk_alpha:  -log alpha, acceptance maximised directly (cross-entropy where p is one token).
    Rows are summed and divided as the KL loss's (`step_loss`)."""
    logp = torch.log_softmax(_wide(draft_logits), dim=-1)
    p = _wide(target_p)
    alpha = overlap(logp.exp(), p)  # acceptance_rate, from the log-softmax this loss needs anyway
    if kind == "lk_alpha":
        return weight * -torch.log(alpha.clamp(min=1e-5))
    if kind != "lk_hybrid":
        raise ValueError(f"model.loss: {kind!r} is not kl, lk_hybrid or lk_alpha")
    kl = (p * (torch.log(p.clamp(min=1e-30)) - logp)).sum(-1)
    lam = torch.exp(-LK_DECAY * alpha.detach())
    return weight * (lam * kl + (1 - lam) * (1 - alpha))


def dpace_weights(conf: torch.Tensor, valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE position weights over chains [M, K] (a DFlash block's slots, or one start position's TTT
    steps): the derivative of the expected accepted length sum_j prod_{i<=j} c_i with respect to log c_k,
    on smoothed confidences c = (1 - alpha) * conf + alpha (1 where a slot is not counted):
    w_k = valid_k * sum_{j>=k} valid_j * prod_{i<=j} c_i. Slot 1 weighs most; later slots gain weight as
    the earlier ones become reliable. No gradient flows through it."""
    v = valid.to(conf.dtype)
    c = torch.where(valid, (1 - alpha) * conf.detach() + alpha, torch.ones_like(conf))
    run = torch.cumprod(c, dim=-1) * v
    return run.flip(-1).cumsum(-1).flip(-1) * v


def round_rejections(correct: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Where a chain draft of the head is rejected when it decodes the row's own text: correct [B, T, L]
    (step s at position i right, as `step_correct`; False where not counted), loss_mask [B, T] -> [B, T, L]
    bool, True at (i, a) for each round that starts at i and accepts a < L drafted tokens.

    In each run of loss tokens a .. e-1 (text the target wrote), the first round starts at i = a - 1: the
    target's first token a is the bonus, step s predicts token i + 2 + s. A round accepts the leading right
    steps A, then the target's token at i + 2 + A is the next bonus: the next round starts at i + A + 1. On
    the target's own greedy text these are the rounds our engine's chain decode runs (the draft equals the
    TTT step where every earlier step was right), so no decode pass is needed to find them."""
    b, t, L = correct.shape
    acc = torch.cumprod(correct.int(), dim=-1).sum(-1).tolist()  # leading right steps at each position
    mask = loss_mask.tolist()
    out = torch.zeros(b, t, L, dtype=torch.bool)
    for r in range(b):
        j = 0
        while j < t:
            if not mask[r][j]:
                j += 1
                continue
            e = j
            while e < t and mask[r][e]:
                e += 1
            i = max(j - 1, 0)
            while i + 2 < e:
                a = acc[r][i]
                if a < L and i + 2 + a < e:
                    out[r, i, a] = True
                i += a + 1
            j = e
    return out.to(correct.device)


def step_correct(draft_logits: torch.Tensor, d2t: torch.Tensor, target_argmax: torch.Tensor) -> torch.Tensor:
    """Per position: draft argmax mapped to target ids equals the target's argmax."""
    draft_ids = row_argmax(draft_logits)
    return (draft_ids + d2t[draft_ids]) == target_argmax


def topk_hit(draft_logits: torch.Tensor, d2t: torch.Tensor, target_argmax: torch.Tensor, k: int) -> torch.Tensor:
    """Per position: the target's argmax is among the draft's k likeliest tokens (mapped to target ids), so a
    tree node expanded to its top k children holds the token verification accepts."""
    ids = draft_logits.topk(min(k, draft_logits.shape[-1]), dim=-1).indices
    return ((ids + d2t[ids]) == target_argmax[:, None]).any(-1)


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


def ttt_unroll(head, aux: torch.Tensor, emb: torch.Tensor, ttt_length: int, flash: bool | None = None):
    """The TTT steps of an Eagle3Head over a padded batch (index rules above): yields step s's output
    state [B, T, H] (`head.finish`'s; `head.logits` of it are the step's logits) for s = 0 .. ttt_length-1.
    aux [B,T,3Ht]; emb [B,T,H], embeddings of input_ids. flash: PyTorch's flash kernel
    (trainer/ttt_flash.py, CPU or CUDA) for the attention; None = wherever it runs, False = the blocked
    reference."""
    b, t, _ = emb.shape
    h = head.features(aux)
    attn_mod = head.midlayer.self_attn
    if flash is None:
        flash = flash_available(h, attn_mod.head_dim)
    elif flash and not flash_available(h, attn_mod.head_dim):
        raise ValueError(f"model.attention: flash needs PyTorch's flash kernel (CPU fp32 / fp64 / bf16; CUDA "
                         f"bf16 / fp16, sm80+, head dim <= 256), not {h.device.type} {h.dtype}; use auto or blocked")
    causal = None if flash else torch.full((t, t), float("-inf"), device=emb.device, dtype=h.dtype).triu(1)
    keys, values = [], []
    for s in range(ttt_length):
        pos = (torch.arange(t, device=emb.device) + s).unsqueeze(0).expand(b, t)
        q, k, v = head.qkv(h, shift_left(emb, 1 + s), pos)
        keys.append(attn_mod.expand(k))
        values.append(attn_mod.expand(v))
        attn = ttt_attention_flash(q, keys, values) if flash else ttt_attention(q, keys, values, causal)
        h = head.finish(h, attn)
        yield h


class TTTObjective(nn.Module):
    """The training objective around a head (what the DeepSpeed engine wraps): forward = the weighted TTT
    loss plus per-step metrics. Parameters are the head's under the `head.` prefix.

    The draft lm_head, the softmax and the loss run only on the positions a step counts (loss tokens
    inside the sequence): prompt, padding and the tail past the sequence cost no vocab-sized work."""

    def __init__(self, head: nn.Module, ttt_length: int, decay: float, attention: str = "auto",
                 compile: bool = False, off_vocab: str = "drop", labels: str = "soft",
                 dpace_alpha: float | None = None, loss: str = "kl", rejection_boost: float = 0.0,
                 loss_norm: str = "positions", align_topk: int = 0):
        """Each step's loss sum is divided by every position of the batch (padding and prompt included).
        off_vocab: where the target's argmax is outside the draft vocabulary, "drop" the position from the
        loss, or "keep" it (the target's distribution over the draft vocab). labels: "soft" (the target's
        distribution) or "hard" (its argmax). dpace_alpha: weigh each position's steps by `dpace_weights`
        (each start position a chain of ttt_length steps) in place of decay ** s. loss: "kl", or an LK
        loss (`lk_losses`: lk_hybrid, lk_alpha), with soft labels and the decay weights. rejection_boost:
        each row where this batch's chain decode would be rejected (`round_rejections`, from the current
        head's own steps) weighs 1 + rejection_boost (0: off), the rest 1. loss_norm: each step's row sum is
        divided by every position of the batch ("positions"), or by the rows the step counts ("tokens":
        speculators' mean; with the decay weights). align_topk k (GRIFFIN's token alignment, ARCHITECTURE.md
        §6): step s counts position i only where every earlier step at i held the target's token in its top k
        (`topk_hit`): the rows a top-k tree decode reaches; 0: off."""
        super().__init__()
        self.head, self.ttt_length, self.weights = head, ttt_length, step_weights(ttt_length, decay)
        self.keep_off_vocab = off_vocab == "keep"
        self.hard, self.dpace_alpha, self.loss = labels == "hard", dpace_alpha, loss
        if loss != "kl" and (self.hard or dpace_alpha is not None):
            raise ValueError(f"model.loss: {loss} needs labels: soft and position_weight: decay")
        if rejection_boost and dpace_alpha is not None:
            raise ValueError("model.rejection_boost: with position_weight: decay (D-PACE weighs rows itself)")
        if loss_norm == "tokens" and dpace_alpha is not None:
            raise ValueError("model.loss_norm: tokens with position_weight: decay")
        self.boost, self.per_token, self.align_topk = rejection_boost, loss_norm == "tokens", align_topk
        self.flash = {"auto": None, "flash": True, "blocked": False}[attention]
        self.step_loss = step_loss
        if compile:
            self.compile_pieces()
        self._register_load_state_dict_pre_hook(_add_head_prefix)

    @property
    def steps(self) -> int:
        """Metric steps (StepSums): one per TTT step."""
        return self.ttt_length

    def compile_pieces(self) -> None:
        """torch.compile the step's pieces between the attention calls (ARCHITECTURE.md §6,
        "Attention"): the head's qkv and finish (fixed shapes per batch shape), its logits and the step loss (the
        counted rows differ per step: dynamic). The attention stays outside, an autograd Function of its own."""
        head = self.head
        head.qkv, head.finish = torch.compile(head.qkv), torch.compile(head.finish)
        head.logits = torch.compile(head.logits, dynamic=True)
        self.step_loss = torch.compile(step_loss, dynamic=True)

    def forward(self, aux: torch.Tensor, emb: torch.Tensor, target_p: torch.Tensor, target_argmax: torch.Tensor,
                target_row: torch.Tensor, loss_mask: torch.Tensor) -> dict:
        """target_p [N,Vd] and target_argmax [N]: the compact target table of `target_rows`, whose
        `row` [B,T] is target_row; loss_mask [B,T]."""
        total = aux.new_zeros((), dtype=torch.float32)
        positions = loss_mask.numel()
        losses, correct, counted, parts = [], [], [], []
        reached = torch.ones(positions, dtype=torch.bool, device=loss_mask.device)  # align_topk's chains
        for s, x in enumerate(ttt_unroll(self.head, aux, emb, self.ttt_length, self.flash)):
            sel = shift_left(loss_mask, 2 + s).flatten().nonzero().squeeze(1)
            rows = shift_left(target_row, 1 + s, fill=-1).flatten()[sel]
            logits = self.head.logits(x.flatten(0, 1)[sel])
            tgt_am = target_argmax[rows]
            weight = (torch.ones_like(tgt_am, dtype=logits.dtype) if self.keep_off_vocab
                      else self.head.t2d[tgt_am].to(logits.dtype))
            if self.align_topk:
                weight, reached = self._aligned(weight, reached, sel, logits, tgt_am)
            if self.loss != "kl":
                elem, conf = lk_losses(self.loss, logits, target_p[rows], weight), None
            elif self.hard or self.dpace_alpha is not None or self.boost:
                elem, conf = position_losses(logits, target_p[rows], weight, self.hard, self.dpace_alpha is not None)
            else:
                elem = conf = None
            norm = max(1, len(sel)) if self.per_token else positions
            loss = self.step_loss(logits, target_p[rows], weight, norm) if elem is None else elem.sum() / norm
            with torch.no_grad():
                right = step_correct(logits, self.head.d2t, tgt_am)
                correct.append(right.sum())
                counted.append(torch.tensor(float(len(sel)), device=sel.device))
            parts.append((sel, elem, conf, right, norm))
            if self.dpace_alpha is None and not self.boost:
                total = total + self.weights[s] * loss
            losses.append(loss.detach())
        if self.dpace_alpha is not None:
            total = total + self._dpace_total(parts, positions)
        elif self.boost:
            total = total + self._rejection_total(parts, loss_mask)
        return {"loss": total, "step_loss": torch.stack(losses), "step_correct": torch.stack(correct).float(),
                "step_count": torch.stack(counted).float()}

    def _aligned(self, weight, reached, sel, logits, tgt_am):
        """align_topk: this step's row weights times whether its chain was reached, and the chains the next
        step reaches (those counted here whose target token is in the draft's top k)."""
        now = reached[sel]
        nxt = torch.zeros_like(reached)
        with torch.no_grad():
            nxt[sel] = now & topk_hit(logits, self.head.d2t, tgt_am, self.align_topk)
        return weight * now.to(weight.dtype), nxt

    def _rejection_total(self, parts: list, loss_mask: torch.Tensor) -> torch.Tensor:
        """sum over steps s of decay ** s * sum_rows (1 + boost * rejected[row, s]) * loss / the step's norm."""
        b, t = loss_mask.shape
        right = torch.zeros(b * t, len(parts), dtype=torch.bool, device=loss_mask.device)
        for s, (sel, _, _, r, _) in enumerate(parts):
            right[sel, s] = r
        rejected = round_rejections(right.view(b, t, -1), loss_mask).view(b * t, -1)
        return sum(self.weights[s] * ((1 + self.boost * rejected[sel, s].to(elem.dtype)) * elem).sum() / norm
                   for s, (sel, elem, _, _, norm) in enumerate(parts))

    def _dpace_total(self, parts: list, positions: int) -> torch.Tensor:
        """sum over steps s of sum_rows w[row, s] * loss / positions, where each start position (flat row)
        is a chain over the steps and w its `dpace_weights` (zero where a step does not count)."""
        conf = parts[0][2].new_zeros((positions, len(parts)))
        valid = torch.zeros(conf.shape, dtype=torch.bool, device=conf.device)
        for s, (sel, _, c, _, _) in enumerate(parts):
            conf[sel, s], valid[sel, s] = c.to(conf.dtype), True
        w = dpace_weights(conf, valid, self.dpace_alpha)
        return sum((w[sel, s].to(elem.dtype) * elem).sum() / positions for s, (sel, elem, _, _, _) in enumerate(parts))


def _add_head_prefix(state: dict, prefix: str, *_args) -> None:
    """Checkpoints written before the objective existed hold the head's names bare: read them as `head.*`."""
    for k in [k for k in state if k.startswith(prefix) and not k.startswith(prefix + "head.")]:
        state[prefix + "head." + k[len(prefix):]] = state.pop(k)
