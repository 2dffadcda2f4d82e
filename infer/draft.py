"""The draft side: an EAGLE-3 head with its own KV cache of committed positions, and tree growth.

A draft element pairs the feature of target position i (fc of the target's aux states, or the draft's
own output standing in for it) with the embedding of the token at i + 1, rotated at position i. The
cache holds committed elements only; tree elements live in per-round lists and are dropped after it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from infer.tree import Candidates, Tree, finalize, grow, rerank
from trainer.head import Eagle3Head


class DraftRunner:
    def __init__(self, head: Eagle3Head, embed: torch.Tensor):
        self.head = head.eval()
        self.embed = embed
        attn = head.midlayer.self_attn
        self.kv_heads, self.head_dim = attn.kv_heads, attn.head_dim
        self.level_logits: list[torch.Tensor] = []  # the last tree's draft logits per level (tests read it)
        self.reset()

    def reset(self) -> None:
        p = self.embed
        self.k = p.new_zeros((1, self.kv_heads, 0, self.head_dim))
        self.v = p.new_zeros((1, self.kv_heads, 0, self.head_dim))

    @property
    def cached(self) -> int:
        return self.k.shape[2]

    def _step(self, h: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
              keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor):
        """m elements attending to `keys/values` (+ themselves, last m slots). mask [m, K + m] bool."""
        q, k, v = self.head.qkv(h[None], F.embedding(tokens, self.embed)[None], positions[None])
        kk, vv = torch.cat([keys, k], dim=2), torch.cat([values, v], dim=2)
        out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask[None, None], enable_gqa=True)
        x = self.head.finish(h[None], out)[0]
        return x, self.head.logits(x), k, v

    @torch.no_grad()
    def ingest(self, aux: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor):
        """Commit elements for target positions `positions` (features aux [n, 3Ht], next tokens [n]).
        Returns the last element's pre-norm output and logits (they propose the next token's children)."""
        n, c = len(next_tokens), self.cached
        h = self.head.fc(aux.to(self.embed.dtype))
        mask = torch.cat([torch.ones(n, c, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()], dim=1)
        x, logits, k, v = self._step(h, next_tokens, positions, self.k, self.v, mask.to(h.device))
        self.k, self.v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        return x[-1], logits[-1]

    @torch.no_grad()
    def build_tree(self, root_token: int, root_hidden: torch.Tensor, root_logits: torch.Tensor, last_pos: int,
                   top_k: int, depth: int, total_tokens: int) -> Tree:
        """EAGLE-2 dynamic tree: top_k children of the root from the last ingest output, then depth - 1
        rounds expanding the top_k frontier nodes in one forward each, then rerank to total_tokens."""
        d2t = self.head.d2t
        cands = Candidates([], [], [], [])

        def children(logits: torch.Tensor):
            lp, idx = torch.log_softmax(logits.float(), dim=-1).topk(top_k, dim=-1)
            return idx + d2t[idx], lp

        tok, lp = children(root_logits[None])
        self.level_logits = [root_logits[None]]
        frontier = grow(cands, [-1], tok, lp, top_k)
        elem_of: dict[int, int] = {}  # candidate -> tree element index
        hid, ks, vs = [], [], []      # per tree element: output, key, value
        for _ in range(depth - 1):
            parents_h = torch.stack([root_hidden if cands.parents[c] < 0 else hid[elem_of[cands.parents[c]]]
                                     for c in frontier])
            tokens = torch.tensor([cands.tokens[c] for c in frontier], device=root_hidden.device)
            positions = torch.tensor([last_pos + cands.depths[c] for c in frontier], device=root_hidden.device)
            e = len(hid)
            anc = torch.zeros(len(frontier), e, dtype=torch.bool)
            for row, c in enumerate(frontier):
                p = cands.parents[c]
                while p >= 0:
                    anc[row, elem_of[p]] = True
                    p = cands.parents[p]
            mask = torch.cat([torch.ones(len(frontier), self.cached, dtype=torch.bool), anc,
                              torch.eye(len(frontier), dtype=torch.bool)], dim=1).to(root_hidden.device)
            tree_k = torch.cat([self.k] + ks, dim=2) if ks else self.k
            tree_v = torch.cat([self.v] + vs, dim=2) if vs else self.v
            x, logits, k, v = self._step(parents_h, tokens, positions, tree_k, tree_v, mask)
            for row, c in enumerate(frontier):
                elem_of[c] = e + row
                hid.append(x[row])
            ks.append(k)
            vs.append(v)
            self.level_logits.append(logits)
            tok, lp = children(logits)
            frontier = grow(cands, frontier, tok, lp, top_k)
        return finalize(root_token, cands, rerank(cands, total_tokens))
