"""The tree round's hot path in fixed-size tensor ops: candidate table, frontier, rerank, finalize, greedy
acceptance. `infer/tree.py` is the reference: these give the same candidates, the same tie-breaks, the
same tree and the same accepted path (tests/test_tree.py checks them against it).

Candidates are numbered in creation order: the root's top_k children, then each level's frontier x top_k
children row by row, so depth never decreases with the index. A stable descending sort by score therefore
breaks ties by (depth, index), the sort keys of tree.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from infer.tree import Tree


@dataclass
class CandidateTable:
    """Every node scored while growing one tree (root excluded), preallocated; parent -1 = the root."""
    tokens: torch.Tensor   # [capacity] long
    parents: torch.Tensor  # [capacity] long
    scores: torch.Tensor   # [capacity] fp32, cumulative draft log-probability from the root
    depths: torch.Tensor   # [capacity] long, 1 for the root's children
    n: int = 0

    @classmethod
    def empty(cls, capacity: int, device=None) -> "CandidateTable":
        z = torch.zeros(capacity, dtype=torch.long, device=device)
        return cls(z.clone(), z.clone(), torch.zeros(capacity, device=device), z.clone())

    @staticmethod
    def capacity(top_k: int, depth: int) -> int:
        """The root's top_k children plus top_k x top_k per expanded level."""
        return top_k + (depth - 1) * top_k * top_k

    def add(self, parents: torch.Tensor, child_tokens: torch.Tensor, child_logp: torch.Tensor) -> torch.Tensor:
        """Record the children of `parents` ([m] candidate indices, -1 = root; rows of child_tokens /
        child_logp [m, k]) row by row; returns their candidate indices [m * k]."""
        m, k = child_tokens.shape
        has = parents >= 0
        p = parents.clamp(min=0)
        base = torch.where(has, self.scores[p], 0.0)
        depth = torch.where(has, self.depths[p] + 1, 1)
        idx = torch.arange(self.n, self.n + m * k, device=self.tokens.device)
        self.tokens[idx] = child_tokens.reshape(-1)
        self.parents[idx] = parents.repeat_interleave(k)
        self.scores[idx] = (base[:, None] + child_logp.float()).reshape(-1)
        self.depths[idx] = depth.repeat_interleave(k)
        self.n += m * k
        return idx

    def best(self, idx: torch.Tensor, count: int) -> torch.Tensor:
        """The `count` best of candidates `idx` (ascending indices) by score, ties to the lower index
        (tree.grow's next frontier)."""
        order = torch.sort(self.scores[idx], descending=True, stable=True).indices
        return idx[order[:count]]


def rerank_tensor(table: CandidateTable, total_tokens: int) -> torch.Tensor:
    """tree.rerank: the best (total_tokens - 1) candidates, returned in creation order. A child's score is
    its parent's plus a log-probability <= 0 and its index is larger, so no child outranks its parent and
    the kept set is a connected tree."""
    kept = table.best(torch.arange(table.n, device=table.tokens.device), max(0, total_tokens - 1))
    return kept.sort().values


def finalize_tensor(root_token: int, table: CandidateTable, kept: torch.Tensor) -> Tree:
    """tree.finalize for kept candidate indices (ascending): root at node 0, ancestor mask by pointer
    jumping (one tensor op per level)."""
    dev = table.tokens.device
    n = kept.numel() + 1
    node_of = torch.zeros(table.n, dtype=torch.long, device=dev)
    node_of[kept] = torch.arange(1, n, device=dev)
    cp = table.parents[kept]
    parents = torch.cat([torch.tensor([-1], device=dev), torch.where(cp < 0, 0, node_of[cp.clamp(min=0)])])
    depth = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), table.depths[kept]])
    tokens = torch.cat([torch.tensor([root_token], device=dev), table.tokens[kept]])
    mask = torch.eye(n, dtype=torch.bool, device=dev)
    rows, cur = torch.arange(n, device=dev), parents.clone()
    for _ in range(int(depth.max())):
        has = cur >= 0
        mask[rows[has], cur[has]] = True
        cur = torch.where(has, parents[cur.clamp(min=0)], -1)
    return Tree(tokens, parents, depth, mask)


def accept_greedy_tensor(tree: Tree, target_argmax: torch.Tensor) -> tuple[list[int], int]:
    """tree.accept_greedy without a per-node loop: a node is on the accepted path iff it and every
    ancestor carry the target's argmax at their parent. A node's children hold distinct tokens (top-k of
    one distribution), so those nodes form one root-to-node chain, in creation order."""
    want = target_argmax[tree.parents.clamp(min=0)]
    good = tree.tokens == want
    good[0] = True
    on_path = ~(tree.mask & ~good[None, :]).any(dim=1)
    path = on_path.nonzero().flatten()
    return path.tolist(), int(target_argmax[path[-1]])
