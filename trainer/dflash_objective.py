"""Training a DFlash head (ARCHITECTURE.md §14) as pure functions: anchors, the block mask, labels, metrics.

A row of T positions gives N anchor blocks. Block n at anchor a = anchors[n] holds the token at a, then
B - 1 masks, at positions a .. a + B - 1. Its queries see context positions j < a (the target's aux states
there) and every slot of their own block, never another block. Slot k (1 <= k < B) learns the target's
distribution at position a + k - 1 (the prediction of token a + k), counted where token a + k is a loss
token inside the row. An anchor is any a >= 1 whose next token a + 1 is a loss token (slot 1 counts).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from trainer.ttt import dpace_weights, lk_losses, position_losses, row_argmax


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: a may anchor a block (a >= 1, token a + 1 is a loss token)."""
    ok = torch.zeros_like(loss_mask, dtype=torch.bool)
    ok[:, 1:-1] = loss_mask[:, 2:].bool()
    return ok


def sample_anchors(loss_mask: torch.Tensor, count: int, generator: torch.Generator | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `count` distinct anchors per row, uniformly among the candidates, ascending -> (anchors [B, N]
    long, keep [B, N] bool); N = min(count, most candidates in a row); a row with fewer fills with 0, keep False."""
    ok = anchor_candidates(loss_mask)
    n = max(1, min(count, int(ok.sum(1).max())))
    r = torch.rand(ok.shape, generator=generator, device=generator.device if generator else ok.device)
    r = torch.where(ok, r.to(ok.device), torch.full_like(r, 2.0, device=ok.device))
    picked = r.topk(n, dim=1, largest=False)
    keep = picked.values < 2.0
    anchors = torch.where(keep, picked.indices, torch.zeros_like(picked.indices))
    order = torch.where(keep, anchors, torch.full_like(anchors, ok.shape[1])).argsort(dim=1)
    return anchors.gather(1, order), keep.gather(1, order)


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, N] -> [B, N * block_size]: a + k for each slot."""
    k = torch.arange(block_size, device=anchors.device)
    return (anchors[..., None] + k).flatten(1)


def block_mask(anchors: torch.Tensor, keep: torch.Tensor, seq_len: int, block_size: int,
               causal: bool = False) -> torch.Tensor:
    """[B, 1, N * bs, T + N * bs] bool: query (n, k) sees context j < anchors[n] and its own block's slots
    (causal: its block's slots <= k). A block that is not kept sees its own slots only (no empty softmax
    row); it counts nowhere."""
    b, n = anchors.shape
    dev = anchors.device
    q_anchor = anchors.repeat_interleave(block_size, dim=1)                           # [B, Q]
    ctx = torch.arange(seq_len, device=dev)[None, None, :] < q_anchor[..., None]     # [B, Q, T]
    ctx &= keep.repeat_interleave(block_size, dim=1)[..., None]
    blk = torch.arange(n, device=dev).repeat_interleave(block_size)
    own = blk[:, None] == blk[None, :]                                                # [Q, Q]
    if causal:
        own = own.tril()
    own = own.expand(b, -1, -1)
    return torch.cat([ctx, own], dim=2)[:, None]


def block_labels(anchors: torch.Tensor, keep: torch.Tensor, target_row: torch.Tensor, block_size: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots 1 .. bs-1 of each block -> (rows [B, N, bs-1]: row of position a + k - 1 in the compact target
    table (trainer/ttt.py target_rows), valid [B, N, bs-1]: counted)."""
    t = target_row.shape[1]
    src = anchors[..., None] + torch.arange(block_size - 1, device=anchors.device)   # a + k - 1, k = 1 ..
    inside = src < t
    rows = target_row.gather(1, src.clamp(max=t - 1).flatten(1)).view_as(src)
    valid = inside & (rows >= 0) & keep[..., None]
    return torch.where(valid, rows, torch.zeros_like(rows)), valid


def accepted_prefix(correct: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per slot k, over blocks [B, N, K]: (accepted through k: slots 1..k all right; reached: slots 1..k-1
    right and slot k counted). Their ratio is the chance a chain accepts slot k given it got there."""
    run = torch.cumprod((correct & valid).int(), dim=-1).bool()
    before = torch.cat([torch.ones_like(run[..., :1]), run[..., :-1]], dim=-1)
    return run, before & valid


def slot_weights(block_size: int, gamma: float | None) -> list[float]:
    """Loss weight of slots 1 .. bs-1: exp(-(k - 1) / gamma) (DFlash's position decay); None: all 1."""
    return [math.exp(-(k - 1) / gamma) if gamma else 1.0 for k in range(1, block_size)]


class DFlashObjective(nn.Module):
    """The DFlash training objective around a head (what the DeepSpeed engine wraps), with TTTObjective's
    forward signature and outputs: per-slot loss and the accepted-prefix counts as `step_*` (StepSums)."""

    def __init__(self, head: nn.Module, mask_embedding: torch.Tensor, anchors: int, decay_gamma: float | None,
                 off_vocab: str = "drop", eval_seed: int = 0, labels: str = "soft", dpace_alpha: float | None = None,
                 loss: str = "kl"):
        """labels: "soft" (the target's distribution) or "hard" (its argmax); dpace_alpha: each block's slots
        weighed by trainer/ttt.py `dpace_weights` over the counted slots' mean (speculators' DFlash default,
        with hard labels) in place of the fixed decay. loss: "kl", or an LK loss per counted row
        (trainer/ttt.py `lk_losses`), with soft labels and the fixed decay."""
        super().__init__()
        self.head, self.anchors, self.block = head, anchors, head.config.block_size
        self.keep_off_vocab, self.eval_seed = off_vocab == "keep", eval_seed
        self.hard, self.dpace_alpha, self.loss = labels == "hard", dpace_alpha, loss
        if loss != "kl" and (self.hard or dpace_alpha is not None):
            raise ValueError(f"model.loss: {loss} needs labels: soft and position_weight: decay")
        self.weights = slot_weights(self.block, decay_gamma)
        self.register_buffer("mask_embedding", mask_embedding.detach().clone(), persistent=False)

    @property
    def steps(self) -> int:
        return self.block - 1

    def forward(self, aux: torch.Tensor, emb: torch.Tensor, target_p: torch.Tensor, target_argmax: torch.Tensor,
                target_row: torch.Tensor, loss_mask: torch.Tensor) -> dict:
        """As TTTObjective.forward: aux [B,T,3Ht], emb [B,T,H] (the tokens' embeddings), the compact target
        table (target_p [N,Vd], target_argmax [N], target_row [B,T]), loss_mask [B,T]. Training draws
        anchors from the global RNG; eval from a fixed seed (the same blocks at every evaluation)."""
        b, t, _ = emb.shape
        gen = None if self.training else torch.Generator(device=emb.device).manual_seed(self.eval_seed)
        anchors, keep = sample_anchors(loss_mask, self.anchors, gen)
        bs, n = self.block, anchors.shape[1]
        ctx = self.head.context_kv(aux, torch.arange(t, device=aux.device).expand(b, t))
        x = self.mask_embedding.to(emb.dtype).expand(b, n, bs, -1).clone()
        x[:, :, 0] = emb.gather(1, anchors[..., None].expand(-1, -1, emb.shape[-1]))
        mask = block_mask(anchors, keep, t, bs, self.head.config.block_causal)
        out = self.head.block(x.flatten(1, 2), block_positions(anchors, bs), ctx, mask)
        rows, valid = block_labels(anchors, keep, target_row, bs)
        out = out.view(b, n, bs, -1)[:, :, 1:]
        correct = torch.zeros_like(valid)
        conf = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device)
        elems, losses = [], []
        for k in range(bs - 1):
            sel = valid[:, :, k]
            logits = self.head.logits(out[:, :, k][sel])
            r = rows[:, :, k][sel]
            am = target_argmax[r]
            weight = (torch.ones_like(am, dtype=logits.dtype) if self.keep_off_vocab
                      else self.head.t2d[am].to(logits.dtype))
            elem, conf[:, :, k][sel] = position_losses(logits, target_p[r], weight, self.hard)
            if self.loss != "kl":
                elem = lk_losses(self.loss, logits, target_p[r], weight)
            elems.append(elem)
            losses.append(elem.detach().sum() / max(1, int(sel.sum())))  # the slot's mean over its counted rows
            with torch.no_grad():
                ids = row_argmax(logits)
                correct[:, :, k][sel] = (ids + self.head.d2t[ids]) == am
        run, reached = accepted_prefix(correct, valid)
        return {"loss": self._total(elems, conf, valid), "step_loss": torch.stack(losses),
                "step_correct": run.flatten(0, 1).sum(0).float(), "step_count": reached.flatten(0, 1).sum(0).float()}

    def _total(self, elems: list[torch.Tensor], conf: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The fixed decay: sum_k w_k * (slot k's loss sum) / sum_k w_k * (its count). D-PACE: each counted
        slot's loss times its block's `dpace_weights`, over the number of counted slots."""
        if self.dpace_alpha is None:
            num = sum(w * e.sum() for w, e in zip(self.weights, elems))
            return num / max(sum(w * max(1, len(e)) for w, e in zip(self.weights, elems)), 1e-9)
        w = dpace_weights(conf, valid, self.dpace_alpha)
        num = sum((w[:, :, k][valid[:, :, k]].to(e.dtype) * e).sum() for k, e in enumerate(elems))
        return num / max(int(valid.sum()), 1)
