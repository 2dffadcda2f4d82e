"""Dynamic draft trees (ARCHITECTURE.md §8) as pure functions: grow, rerank, finalize, accept, compact.

Node 0 of a finalized tree is the root: the last committed token, not yet in the target's KV cache.
Nodes are kept in creation order, so every parent precedes its children and a parent's children
appear in descending draft probability.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Tree:
    tokens: torch.Tensor     # [n] token ids, tokens[0] = root
    parents: torch.Tensor    # [n] index of the parent node, -1 for the root
    depth: torch.Tensor      # [n] 0 for the root
    mask: torch.Tensor       # [n, n] bool: node i sees node j iff j is i or an ancestor of i

    @property
    def size(self) -> int:
        return int(self.tokens.numel())

    @property
    def retrieve(self) -> torch.Tensor:
        """[leaves, max_depth + 1] root-to-leaf node indices, padded with -1 (not on the decode path)."""
        is_leaf = torch.ones(self.size, dtype=torch.bool)
        is_leaf[self.parents[self.parents >= 0]] = False
        leaves = is_leaf.nonzero().flatten().tolist()
        out = torch.full((len(leaves), int(self.depth.max()) + 1), -1, dtype=torch.long)
        for row, leaf in enumerate(leaves):
            path = self.mask[leaf].nonzero().flatten()  # ancestors in creation order = root-to-leaf order
            out[row, : len(path)] = path
        return out

    def children(self, node: int) -> list[int]:
        return (self.parents == node).nonzero().flatten().tolist()

    def positions(self, prefix_len: int) -> torch.Tensor:
        """Target positions: a node at depth d sits at prefix_len + d (the root at prefix_len)."""
        return prefix_len + self.depth


@dataclass
class Candidates:
    """Every node scored while growing a tree (root excluded); parent -1 means the root."""
    tokens: list[int]
    parents: list[int]
    scores: list[float]   # cumulative draft log-probability from the root
    depths: list[int]


def grow(cands: Candidates, frontier: list[int], child_tokens: torch.Tensor, child_logp: torch.Tensor,
         top_k: int) -> list[int]:
    """Score the children of every frontier node (rows of child_tokens / child_logp, [len(frontier), k]),
    record them all, and return the best top_k of them as the next frontier (candidate indices).
    frontier == [-1] means the children of the root."""
    new = []
    for row, parent in enumerate(frontier):
        base = 0.0 if parent < 0 else cands.scores[parent]
        depth = 1 if parent < 0 else cands.depths[parent] + 1
        for tok, lp in zip(child_tokens[row].tolist(), child_logp[row].tolist()):
            cands.tokens.append(tok)
            cands.parents.append(parent)
            cands.scores.append(base + lp)
            cands.depths.append(depth)
            new.append(len(cands.tokens) - 1)
    new.sort(key=lambda i: (-cands.scores[i], cands.depths[i], i))
    return new[:top_k]


def rerank(cands: Candidates, total_tokens: int) -> list[int]:
    """The best (total_tokens - 1) candidates by score, ties to the shallower (a child never outranks its
    parent, so the kept set is a connected tree), returned in creation order."""
    order = sorted(range(len(cands.tokens)), key=lambda i: (-cands.scores[i], cands.depths[i], i))
    kept = set(order[: max(0, total_tokens - 1)])
    for i in list(kept):  # defensive: pull in any missing ancestor (only possible with NaN scores)
        p = cands.parents[i]
        while p >= 0 and p not in kept:
            kept.add(p)
            p = cands.parents[p]
    return sorted(kept)


def finalize(root_token: int, cands: Candidates, kept: list[int]) -> Tree:
    """Kept candidates -> Tree with the root at index 0, ancestor mask and depths."""
    index = {c: i + 1 for i, c in enumerate(kept)}
    n = len(kept) + 1
    tokens = torch.tensor([root_token] + [cands.tokens[c] for c in kept], dtype=torch.long)
    parents = torch.tensor([-1] + [0 if cands.parents[c] < 0 else index[cands.parents[c]] for c in kept],
                           dtype=torch.long)
    depth = torch.zeros(n, dtype=torch.long)
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        p = int(parents[i])
        depth[i] = depth[p] + 1
        mask[i] |= mask[p]
    return Tree(tokens, parents, depth, mask)


def accept_greedy(tree: Tree, target_argmax: torch.Tensor) -> tuple[list[int], int]:
    """Longest root-to-node path whose every token equals the target's argmax at its parent.
    Returns (accepted node indices starting with the root, bonus token = argmax after the last one)."""
    node, accepted = 0, [0]
    while True:
        want = int(target_argmax[node])
        nxt = next((c for c in tree.children(node) if int(tree.tokens[c]) == want), None)
        if nxt is None:
            return accepted, want
        accepted.append(nxt)
        node = nxt


def accept_sampling(tree: Tree, target_probs: torch.Tensor, generator: torch.Generator | None = None
                    ) -> tuple[list[int], int]:
    """Lossless multi-candidate acceptance. target_probs [n, V]: the target's (temperature / top-p
    processed) next-token distribution at every node. At each node its children are tried in order:
    child x is accepted with probability p(x) of the current residual; on rejection p(x) is zeroed and
    the residual renormalised; if none is accepted the bonus token is drawn from the residual.
    A rejected child never comes back: a child holding all the residual mass is accepted outright (its
    probability is 1 in exact arithmetic; rounding could otherwise reject it and leave nothing to draw)."""
    node, accepted = 0, [0]
    while True:
        p = target_probs[node].double().clone()
        moved = False
        for c in tree.children(node):
            x = int(tree.tokens[c])
            rest = float(p.sum() - p[x])
            if rest <= 0 or torch.rand((), generator=generator, dtype=torch.float64) < p[x]:
                if p[x] <= 0:  # no mass anywhere (an all-zero row): nothing to accept
                    break
                accepted.append(c)
                node, moved = c, True
                break
            p[x] = 0.0
            p /= rest
        if not moved:
            return accepted, int(torch.multinomial(p.float(), 1, generator=generator))


def compaction_indices(prefix_len: int, accepted: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """KV rows to keep after a verify: tree slots prefix_len + node -> committed slots prefix_len + i."""
    src = prefix_len + torch.tensor(accepted, dtype=torch.long)
    dst = prefix_len + torch.arange(len(accepted), dtype=torch.long)
    return src, dst


def verify_mask(tree: Tree, prefix_len: int, dtype: torch.dtype, window: int | None = None,
                chunk: int | None = None) -> torch.Tensor:
    """Additive 4D mask [1, 1, n, prefix_len + n]: the whole prefix plus each node's ancestors, for a
    full-attention layer. A sliding-window layer (`window`) also hides keys at positions <= q - window,
    as transformers' sliding mask does; a chunked layer (`chunk`) hides keys of other chunks. Positions:
    prefix slot p is position p, node j is at prefix_len + depth[j] (the committed cache is contiguous)."""
    n, dev = tree.size, tree.mask.device  # on the tree's device (a GPU draft builds trees there)
    visible = torch.cat([torch.ones(n, prefix_len, dtype=torch.bool, device=dev), tree.mask], dim=1)
    q_pos = prefix_len + tree.depth
    k_pos = torch.cat([torch.arange(prefix_len, device=dev), q_pos])
    if window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    if chunk is not None:
        visible &= (k_pos[None, :] // chunk) == (q_pos[:, None] // chunk)
    mask = torch.zeros(n, prefix_len + n, dtype=dtype, device=dev)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None]


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The target's sampling distribution, with the same temperature / top-p rules as HF generate."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    scores = TemperatureLogitsWarper(temperature)(None, logits.float())
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, dim=-1)
