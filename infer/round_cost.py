"""Cost-sized draft trees: each round grows and verifies only what this machine's measured costs pay for
(docs/ARCHITECTURE.md §8 "Cost-sized trees").

A fixed tree shape is right for one machine and one target: where a verified node is dear (the demo
target in bf16 on a CPU without AMX, ~19% of a 1-token step per node) a 16-node tree verifies mostly
nodes that will be rejected, and where it is cheap a small tree leaves acceptance unused. With
`sizing: adaptive` the shape's numbers are caps, and per round:
- *depth*: another draft level is grown only while the frontier's best node (cumulative draft
  probability pi from the root) reaches `grow_threshold` = (one level + one verified node) / a 1-token
  step, the share of a token that the extra level and its best node cost;
- *width*: of every candidate grown, the best m by score are verified, m maximising the expected tokens
  per millisecond (1 + sum of their pi) / (base + m x node), base = the draft's cost so far + the verify's
  fixed part. Scores sorted descending keep the tree connected (a child never outranks its parent).
Which nodes are verified never changes the output: acceptance still takes the target's own choices.
Per request, `Calibration` scales every pi by how much of the draft the target has been accepting
(accepted tokens over the sum of pi over verified nodes, decayed), so an overconfident head on an
off-domain prompt grows shallower, narrower trees and a well-aligned one keeps its full shape.
`DraftGate` goes one step further: when drafting rounds stop paying for themselves (a weak head, an
off-domain prompt), the decoder takes plain 1-token steps and does not run the draft at all.
"""
from __future__ import annotations

import copy
import math
import statistics
import time
from dataclasses import dataclass, field

import torch

from infer.tree import Tree
from pipeline.target import text_config


@dataclass(frozen=True)
class RoundCosts:
    """Milliseconds on this machine for one target + head; the `*_per_key` terms scale with the
    committed prefix (attention). step = a 1-token target forward, node = each further verified node,
    level = one draft level (forward + tree ops), ingest = the draft's ingest of a round's tokens."""
    step: float
    step_per_key: float
    node: float
    node_per_key: float
    level: float
    ingest: float

    def at(self, prefix_len: int) -> tuple[float, float]:
        """(step, node) milliseconds after a prefix of prefix_len tokens."""
        return (max(1e-3, self.step + self.step_per_key * prefix_len),
                max(0.0, self.node + self.node_per_key * prefix_len))

    def plan(self, prefix_len: int) -> "RoundPlan":
        """What `DraftRunner.build_tree` needs for one round after prefix_len committed tokens."""
        step, node = self.at(prefix_len)
        return RoundPlan(grow_threshold=(self.level + node) / step, base_ms=self.ingest + step,
                         level_ms=self.level, node_ms=node, step_ms=step)


@dataclass(frozen=True)
class RoundPlan:
    """One round's sizing: grow another level while the frontier's best calibration x pi >= grow_threshold;
    verify `sized_width` drafted nodes."""
    grow_threshold: float
    base_ms: float
    level_ms: float
    node_ms: float
    step_ms: float
    calibration: float = 1.0  # Calibration.factor: the request's accepted / drafted pi so far

    def log_threshold(self) -> float:
        """The bar a frontier's best log pi must reach for another level."""
        return math.log(self.grow_threshold / self.calibration) if self.grow_threshold > 0 else -math.inf

    def round_ms(self, levels: int, nodes: int) -> float:
        """Predicted ms of a round that grew `levels` draft levels and verified `nodes` nodes (root
        included); the first level comes with the ingest."""
        return self.base_ms + (levels - 1) * self.level_ms + (nodes - 1) * self.node_ms

    def gained(self, accepted: int, levels: int, nodes: int) -> float:
        """Tokens a round gained over plain 1-token steps in the same predicted time: 1 + accepted draft
        tokens, less the round's ms in steps."""
        return 1 + accepted - self.round_ms(levels, nodes) / self.step_ms

    def measured_gain(self, accepted: int, nodes: int, round_ms: float, verify_ms: float) -> float:
        """`gained` from the round's measured ms (draft, verify, accept; the ingest still to come is the
        plan's). The plain step it competes with is the plan's step scaled by measured / predicted verify:
        a machine uniformly busier or idler than when the costs were measured moves both sides alike, and
        the round's real overheads (Python, tree ops) count."""
        scale = verify_ms / max(1e-6, self.step_ms + (nodes - 1) * self.node_ms)
        step = max(1e-6, self.step_ms * scale)
        return 1 + accepted - (round_ms + (self.base_ms - self.step_ms) * scale) / step


@dataclass
class Calibration:
    """Per request: the target's acceptance against the draft's own belief. Each drafting round records
    its accepted draft tokens and `expected` = the sum of pi over the nodes it verified (what the draft
    believed it would get accepted); factor = (decayed accepted + prior) / (decayed expected + prior) in
    [floor, ceil]. The prior (one token's worth) keeps the first rounds near 1. Pure bookkeeping."""
    decay: float = 0.8
    prior: float = 1.0
    floor: float = 0.05
    ceil: float = 2.0
    accepted: float = field(default=0.0, init=False)
    expected: float = field(default=0.0, init=False)

    def record(self, accepted: int, expected: float) -> None:
        self.accepted = self.decay * self.accepted + accepted
        self.expected = self.decay * self.expected + expected

    @property
    def factor(self) -> float:
        raw = (self.accepted + self.prior) / (self.expected + self.prior)
        return min(self.ceil, max(self.floor, raw))


@dataclass
class DraftGate:
    """Whether the next `sizing: adaptive` round drafts (docs/ARCHITECTURE.md §8). Each drafting
    round reports `RoundPlan.gained`; while their moving average (weight `decay` on the past) is below 0,
    the decoder takes `backoff` plain steps (the draft idle, its inputs kept for one catch-up ingest), then
    probes with one drafting round, scored alone. A losing probe doubles the backoff (up to
    `max_backoff`), a winning one resets it. Pure bookkeeping: the output is the target's either way."""
    decay: float = 0.5
    min_backoff: int = 2
    max_backoff: int = 32
    calibration: Calibration = field(default_factory=Calibration)  # the same request's pi scale
    score: float | None = field(default=None, init=False)
    backoff: int = field(default=0, init=False)  # starts at min_backoff
    plain_left: int = field(default=0, init=False)
    probing: bool = field(default=False, init=False)
    total: float = field(default=0.0, init=False)  # the request's gains summed (`after`)

    def __post_init__(self):
        self.backoff = self.min_backoff

    @classmethod
    def after(cls, last: "DraftGate | None") -> "DraftGate":
        """A request's gate that goes on from the last request's (`last`, None: a fresh one). Where drafting
        lost over the whole last request, the new one starts with the plain steps the last would have taken
        next and then probes, instead of paying for its first drafting rounds again: a head that loses on one
        kind of traffic stays out of it from one request to the next, and its probes keep the last request's
        calibration (shallow, narrow trees) until acceptance returns. After a request where drafting paid
        in all (a losing stretch at its end included): a fresh gate."""
        gate = cls()
        if last is not None and last.score is not None and last.score < 0 and last.total < 0:
            gate.backoff, gate.score = last.backoff, last.score
            gate.plain_left, gate.probing = last.backoff, True
            gate.calibration = copy.copy(last.calibration)
        return gate

    def drafts(self) -> bool:
        """Whether this round drafts; a plain step is counted off the backoff."""
        if self.plain_left > 0:
            self.plain_left -= 1
            return False
        return True

    def record(self, gained: float) -> None:
        self.total += gained
        fresh = self.score is None or self.probing
        self.score = gained if fresh else self.decay * self.score + (1 - self.decay) * gained
        if self.score < 0:
            if self.probing:
                self.backoff = min(2 * self.backoff, self.max_backoff)
            self.plain_left, self.probing = self.backoff, True
        elif self.probing:
            self.backoff, self.probing = self.min_backoff, False


def cost_width(sorted_scores: torch.Tensor, base_ms: float, node_ms: float, cap: int) -> int:
    """How many of the best candidates to verify. sorted_scores: cumulative draft log-probabilities,
    descending. -> the m in [0, cap] maximising (1 + sum_{i<m} exp(score_i)) / (base_ms + node_ms * m);
    ties to the smaller m."""
    m_max = min(cap, sorted_scores.numel())
    gain = torch.cat([sorted_scores.new_zeros(1), sorted_scores[:m_max].float().exp().cumsum(0)]) + 1.0
    cost = base_ms + node_ms * torch.arange(m_max + 1, dtype=gain.dtype, device=gain.device)
    return int(torch.argmax(gain / cost))  # argmax returns the first maximum


def sized_width(plan: RoundPlan, scores: torch.Tensor, levels: int, cap: int) -> tuple[int, float]:
    """A grown round's verified count: scores = the candidates' cumulative draft log-probabilities (any
    order), levels = levels grown, cap = total_tokens. -> (nodes verified, the root included; expected
    accepted tokens = the sum of the kept candidates' raw pi, for `Calibration`). Widths come from the
    calibrated pi."""
    raw = torch.sort(scores, descending=True).values
    base = plan.base_ms + (levels - 1) * plan.level_ms
    m = cost_width(raw + math.log(plan.calibration), base, plan.node_ms, cap - 1)
    return 1 + m, float(raw[:m].float().exp().sum())


def median_ms(fn, reps: int, sync=lambda: None) -> float:
    """Median wall ms of `reps` calls of fn after two warm-ups; sync (torch.cuda.synchronize on a GPU)
    runs inside each timed call so queued device work is counted."""
    times = []
    for i in range(reps + 2):
        t0 = time.perf_counter()
        fn()
        sync()  # a GPU's queued kernels count too
        if i >= 2:  # two warm-ups
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def probe_tree(n: int) -> Tree:
    """A verify-shaped tree of n nodes: each node's parent is node (i - 1) // 2 (depth ~log2 n)."""
    parents = torch.tensor([-1] + [(i - 1) // 2 for i in range(1, n)])
    depth = torch.zeros(n, dtype=torch.long)
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
        mask[i] |= mask[parents[i]]
    return Tree(torch.arange(n) + 1, parents, depth, mask)


@torch.no_grad()
def measure_round_costs(target, draft, top_k: int, prefixes: tuple[int, int] = (64, 448), nodes: int = 9,
                        reps: int = 5) -> RoundCosts:
    """Time the target's 1-token step and a `nodes`-node verify after two prefix lengths (medians of reps),
    one draft level and one ingest; the draft's cache is reset after. target: infer.target.TargetRunner,
    draft: infer.draft.DraftRunner."""
    vocab = text_config(target.model.config).vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (max(prefixes) + nodes,), generator=gen)
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
    step, node = [], []
    for p in prefixes:
        (t1, tn), aux = target_times(target, ids, p, (1, nodes), reps, sync)
        step.append(t1)
        node.append(max(0.0, (tn - t1) / (nodes - 1)))
    span = prefixes[1] - prefixes[0]
    step_slope, node_slope = (step[1] - step[0]) / span, (node[1] - node[0]) / span
    d = draft_times(draft, aux, ids, prefixes[0], top_k, reps, sync)
    return RoundCosts(step=step[0] - step_slope * prefixes[0], step_per_key=step_slope,
                      node=node[0] - node_slope * prefixes[0], node_per_key=node_slope, level=d["level"],
                      ingest=d["ingest"])


@torch.no_grad()
def target_times(target, ids: torch.Tensor, p: int, sizes, reps: int, sync) -> tuple[list[float], torch.Tensor]:
    """ms of a forward of each size in `sizes` after a p-token prefix of ids (1: the 1-token step; n > 1: a
    `probe_tree(n)` verify under its masks), the cache cut back to p after each; also the prefix's aux."""
    cache = target.new_cache()
    _, aux = target.forward(ids[:p], torch.arange(p), cache, last_only=True)
    empty = torch.zeros(0, dtype=torch.long)

    def one(tokens, positions, mask=None):
        target.forward(tokens, positions, cache, mask)
        target.compact(cache, empty, empty, p)

    times = []
    for n in sizes:
        if n == 1:
            times.append(median_ms(lambda: one(ids[p:p + 1], torch.tensor([p])), reps, sync))
        else:
            tree = probe_tree(n)
            masks = target.verify_masks(tree, p)
            times.append(median_ms(lambda: one(ids[p:p + n], tree.positions(p), masks), reps, sync))
    return times, aux


@torch.no_grad()
def draft_times(draft, aux: torch.Tensor, ids: torch.Tensor, p: int, top_k: int, reps: int, sync,
                depth: int = 3, total_tokens: int = 2) -> dict:
    """ms after a p-token prefix: one draft level (from trees of depth 1 and `depth`), an ingest of 3
    tokens, and the whole tree of `depth`; the draft is reset after."""
    dev = aux.device
    ids = ids.to(dev)
    draft.reset()
    hid, dlog = draft.ingest(aux[:p - 3], ids[1:p - 2], torch.arange(p - 3, device=dev))
    committed = draft.cache.committed

    def ingest():
        draft.cache.committed = committed
        draft.ingest(aux[p - 3:p], ids[p - 2:p + 1], torch.arange(p - 3, p, device=dev))

    t_ingest = median_ms(ingest, reps, sync)
    draft.cache.committed = committed
    grow = [median_ms(lambda: draft.build_tree(int(ids[p]), hid, dlog, p - 1, top_k, d, total_tokens), reps,
                      sync) for d in (1, depth)]
    draft.reset()
    return {"level": max(0.0, (grow[1] - grow[0]) / (depth - 1)), "ingest": t_ingest, "tree": grow[1]}
