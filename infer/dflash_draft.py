"""The DFlash draft side (ARCHITECTURE.md §14) on the decode loop's draft interface (infer/draft.py's
DraftRunner: reset, ingest, build_tree, levels, table, cache.committed).

`ingest` turns the target's aux states of committed positions into every layer's context K/V, at cache
slot = position. `build_tree` runs one forward over the block [root, mask, ...] at positions
last_pos + 1 .. : slot k's distribution proposes the token k levels below the root. One forward gives every
level, so a level's candidates do not depend on which parent they hang under: the tree is each level's
top_k tokens under the best top_k nodes of the level above (a chain when top_k is 1), reranked to
total_tokens by cumulative draft log-probability exactly as EAGLE's (infer/tree_tensor.py).
"""
from __future__ import annotations

import torch

from infer.draft import DraftCache
from infer.round_cost import RoundPlan, sized_width
from infer.tree import Tree
from infer.tree_tensor import CandidateTable, finalize_tensor, rerank_tensor


class LayerCaches:
    """One DraftCache per layer, committed together."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, like: torch.Tensor):
        self.layers = [DraftCache(kv_heads, head_dim, like) for _ in range(layers)]

    @property
    def committed(self) -> int:
        return self.layers[0].committed

    @committed.setter
    def committed(self, n: int) -> None:
        for c in self.layers:
            c.committed = n


class DFlashRunner:
    def __init__(self, head, embed: torch.Tensor):
        self.head, self.embed = head.eval(), embed
        cfg = head.config
        self.block_size = cfg.block_size
        self.mask_embedding = embed[cfg.mask_token_id]
        self.cache = LayerCaches(cfg.num_layers, cfg.num_key_value_heads, cfg.head_dim, embed)
        self.level_logits: list[torch.Tensor] = []  # the last block's draft logits per level
        self.levels = 0
        self.expected = 0.0
        self.table: CandidateTable | None = None

    def reset(self) -> None:
        self.cache.committed = 0

    @property
    def cached(self) -> int:
        return self.cache.committed

    @torch.no_grad()
    def ingest(self, aux: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor):
        """Commit the context of target positions `positions` (aux [n, 3Ht]; next tokens unused: the block
        reads the root's embedding instead). Returns (None, None): no state carries into build_tree."""
        c, n = self.cache.committed, len(positions)
        kv = self.head.context_kv(aux.to(self.embed.dtype)[None], positions[None])
        for cache, (k, v) in zip(self.cache.layers, kv):
            cache.write(c, k, v)
        self.cache.committed = c + n
        return None, None

    @torch.no_grad()
    def block_logits(self, root_token: int, last_pos: int, levels: int) -> torch.Tensor:
        """Draft logits [levels, Vd] of the block [root, mask x levels] at positions last_pos + 1 ..."""
        dev = self.embed.device
        emb = torch.cat([self.embed[root_token][None], self.mask_embedding.expand(levels, -1)])[None]
        pos = (last_pos + 1 + torch.arange(levels + 1, device=dev))[None]
        ctx = [cache.upto(cache.committed) for cache in self.cache.layers]
        mask = None  # every block slot sees the whole context and the block
        if self.head.config.block_causal:  # ... or its block's slots up to itself
            q = levels + 1
            mask = torch.ones(q, ctx[0][0].shape[2] + q, dtype=torch.bool, device=dev)
            mask[:, -q:] = torch.ones(q, q, dtype=torch.bool, device=dev).tril()
            mask = mask[None, None]
        x = self.head.block(emb, pos, ctx, mask)
        return self.head.logits(x[0, 1:])

    @torch.no_grad()
    def build_tree(self, root_token: int, root_hidden, root_logits, last_pos: int, top_k: int, depth: int,
                   total_tokens: int, plan: RoundPlan | None = None) -> Tree:
        """A tree of at most min(depth, block_size - 1) levels from one block forward (module docstring);
        root_hidden / root_logits are ingest's (None) and unused. plan: total_tokens becomes a cap, the
        rerank keeps the cost-optimal count (one forward drafts every level, so levels are not cut)."""
        levels = min(depth, self.block_size - 1)
        logits = self.block_logits(root_token, last_pos, levels)
        self.level_logits = list(logits[:, None])
        lp, idx = torch.log_softmax(logits.float(), dim=-1).topk(top_k, dim=-1)
        tok = idx + self.head.d2t[idx]
        table = CandidateTable.empty(CandidateTable.capacity(top_k, levels), logits.device)
        added = table.add(torch.tensor([-1], device=logits.device), tok[:1], lp[:1])
        for d in range(1, levels):
            frontier = table.best(added, top_k)
            m = frontier.numel()
            added = table.add(frontier, tok[d].expand(m, -1), lp[d].expand(m, -1))
        if plan is not None:
            total_tokens, self.expected = sized_width(plan, table.scores[:table.n], levels, total_tokens)
        self.levels, self.table = levels, table
        return finalize_tensor(root_token, table, rerank_tensor(table, total_tokens))
