"""Tree build / mask / accept / compact as pure functions, checked by hand."""
import collections

import torch
from scipy.stats import chisquare

from infer.tree import (Candidates, Tree, accept_greedy, accept_sampling, compaction_indices, finalize, grow,
                        rerank, verify_mask)


def hand_tree():
    """root -> a(10, -0.1), b(11, -0.5); a -> c(12, -0.2), d(13, -2.0); b -> e(14, -0.1), f(15, -3.0)."""
    cands = Candidates([], [], [], [])
    frontier = grow(cands, [-1], torch.tensor([[10, 11]]), torch.tensor([[-0.1, -0.5]]), top_k=2)
    assert frontier == [0, 1]
    frontier = grow(cands, frontier, torch.tensor([[12, 13], [14, 15]]),
                    torch.tensor([[-0.2, -2.0], [-0.1, -3.0]]), top_k=2)
    assert [cands.tokens[i] for i in frontier] == [12, 14]  # scores -0.3 and -0.6 beat -2.1, -3.5
    return cands


def test_grow_rerank_finalize():
    cands = hand_tree()
    kept = rerank(cands, total_tokens=5)  # root + 4 best: a(-0.1) c(-0.3) b(-0.5) e(-0.6)
    assert kept == [0, 1, 2, 4]
    tree = finalize(99, cands, kept)
    assert tree.tokens.tolist() == [99, 10, 11, 12, 14]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 2]
    assert tree.depth.tolist() == [0, 1, 1, 2, 2]
    assert tree.mask.int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0],
                                        [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]]
    assert tree.retrieve.tolist() == [[0, 1, 3], [0, 2, 4]]
    assert tree.positions(7).tolist() == [7, 8, 8, 9, 9]


def test_rerank_prefers_shallower_on_ties_and_stays_connected():
    cands = Candidates([5, 6, 7], [-1, 0, -1], [-1.0, -1.0, -1.0], [1, 2, 1])
    assert rerank(cands, 3) == [0, 2]  # depth-1 nodes first; the child would need its parent
    assert rerank(cands, 4) == [0, 1, 2]


def test_top_k_one_is_a_chain():
    cands = Candidates([], [], [], [])
    f = grow(cands, [-1], torch.tensor([[3]]), torch.tensor([[-0.1]]), 1)
    for tok in (4, 5):
        f = grow(cands, f, torch.tensor([[tok]]), torch.tensor([[-0.1]]), 1)
    tree = finalize(2, cands, rerank(cands, 4))
    assert tree.tokens.tolist() == [2, 3, 4, 5] and tree.parents.tolist() == [-1, 0, 1, 2]
    assert tree.retrieve.tolist() == [[0, 1, 2, 3]]


def test_accept_greedy_takes_second_branch():
    tree = finalize(99, hand_tree(), [0, 1, 2, 4])
    argmax = torch.tensor([11, 0, 14, 0, 42])  # root wants b (node 2), b wants e (node 4), e then 42
    assert accept_greedy(tree, argmax) == ([0, 2, 4], 42)
    assert accept_greedy(tree, torch.tensor([7, 0, 0, 0, 0])) == ([0], 7)


def test_compaction_and_mask():
    src, dst = compaction_indices(10, [0, 2, 4])
    assert src.tolist() == [10, 12, 14] and dst.tolist() == [10, 11, 12]
    tree = finalize(99, hand_tree(), [0, 1, 2, 4])
    m = verify_mask(tree, 3, torch.float32)[0, 0]
    assert m.shape == (5, 8)
    assert (m[:, :3] == 0).all()
    assert ((m[:, 3:] == 0) == tree.mask).all()


def test_sampling_acceptance_is_lossless():
    """Marginal of the first emitted token equals the target's p, whatever the draft proposes."""
    tree = finalize(99, hand_tree(), [0, 1, 2, 3, 4])  # root children 10, 11
    p = torch.zeros(5, 16)
    p[0, [10, 11, 3]] = torch.tensor([0.2, 0.5, 0.3])
    p[1:, 0] = 1.0
    gen = torch.Generator().manual_seed(0)
    first = collections.Counter()
    n = 20000
    for _ in range(n):
        acc, bonus = accept_sampling(tree, p, gen)
        first[int(tree.tokens[acc[1]]) if len(acc) > 1 else bonus] += 1
    obs = [first[10], first[11], first[3]]
    assert sum(obs) == n
    assert chisquare(obs, [0.2 * n, 0.5 * n, 0.3 * n]).pvalue > 0.01


def grow_both(seed: int, top_k: int, depth: int, vocab: int = 12, quantum: float = 0.5):
    """Grow the same tree with tree.py (reference) and tree_tensor.py from one stream of random draft
    log-probabilities rounded to `quantum` (many exact ties, so the tie-breaks are exercised)."""
    from infer.tree_tensor import CandidateTable

    g = torch.Generator().manual_seed(seed)

    def children(rows: int):
        lp = (torch.log_softmax(torch.randn(rows, vocab, generator=g) * 2, -1) / quantum).round() * quantum
        v, i = lp.topk(top_k, dim=-1)
        return i, v

    ref, table = Candidates([], [], [], []), CandidateTable.empty(CandidateTable.capacity(top_k, depth))
    tok, lp = children(1)
    f_ref = grow(ref, [-1], tok, lp, top_k)
    f_t = table.best(table.add(torch.tensor([-1]), tok, lp), top_k)
    for _ in range(depth - 1):
        assert f_t.tolist() == f_ref
        tok, lp = children(len(f_ref))
        f_ref = grow(ref, f_ref, tok, lp, top_k)
        f_t = table.best(table.add(f_t, tok, lp), top_k)
    assert f_t.tolist() == f_ref
    return ref, table


def test_tensor_tree_equals_reference():
    """The decode loop's tensor path builds the same trees and accepts the same paths as tree.py."""
    from infer.tree_tensor import accept_greedy_tensor, finalize_tensor, rerank_tensor

    g = torch.Generator().manual_seed(7)
    trees = 0
    for seed in range(60):
        top_k, depth = 1 + seed % 4, 1 + seed % 6
        ref, table = grow_both(seed, top_k, depth)
        for total in (2, 5, 16, 40):
            kept = rerank(ref, total)
            assert rerank_tensor(table, total).tolist() == kept
            a, b = finalize(99, ref, kept), finalize_tensor(99, table, torch.tensor(kept, dtype=torch.long))
            for f in ("tokens", "parents", "depth", "mask"):
                assert torch.equal(getattr(a, f), getattr(b, f)), f
            for _ in range(5):  # argmax rows that follow a random path down the tree, leaving it anywhere
                argmax = torch.randint(0, 12, (a.size,), generator=g)
                node = 0
                while (kids := a.children(node)):
                    pick = int(torch.randint(0, len(kids) + 1, (), generator=g))
                    if pick == len(kids):
                        break
                    argmax[node] = a.tokens[kids[pick]]
                    node = kids[pick]
                assert accept_greedy_tensor(b, argmax) == accept_greedy(a, argmax)
            trees += 1
    assert trees == 240


def test_verify_mask_is_built_on_the_trees_device():
    """A GPU draft builds trees on the GPU; the verify mask must follow (the meta device stands in)."""
    tree = Tree(torch.arange(3, device="meta"), torch.tensor([-1, 0, 0], device="meta"),
                torch.tensor([0, 1, 1], device="meta"), torch.eye(3, dtype=torch.bool, device="meta"))
    mask = verify_mask(tree, 5, torch.float32, window=4)
    assert mask.device.type == "meta" and mask.shape == (1, 1, 3, 8)
