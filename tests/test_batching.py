"""Micro-batch planning (trainer/batching.py, pure) and MicroBatches' ranks, without Ray: rank-aligned
batch order, cost-balanced pools, rows traded or planned together across ranks, plans weighted by
measured rank speed (docs/ARCHITECTURE.md §10); the loss mask collate builds."""
import pytest

from trainer.cost import StepFlops, step_flops
from trainer.head import HeadConfig


def smollm2_flops() -> StepFlops:
    """The cost model of a SmolLM2-135M-shaped head with an 8192-token draft vocab, TTT 7."""
    return step_flops(HeadConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                                 num_key_value_heads=3, head_dim=64, vocab_size=49152, draft_vocab_size=8192,
                                 target_hidden_size=576), 7)


def test_batch_order_pairs_similar_sizes_across_ranks():
    """Two ranks' pools (different rows, same length distribution, same pool seed) are planned into the
    agreed count of batches whose padded sizes line up step by step (within 3%; greedy buckets in a shuffled
    order were 473 tokens apart, 3x the paired gap of greedy buckets in the aligned order); every row is
    planned exactly once, within limits."""
    import random

    from trainer.batching import min_batches, plan_batches

    def sizes(lengths, batches):
        return [len(b) * max(lengths[i] for i in b) for b in batches]

    gen = random.Random(0)
    pools = [[gen.choice([gen.randint(8, 60), gen.randint(60, 400)]) for _ in range(256)] for _ in range(2)]
    count = max(min_batches(p, 2048, 16) for p in pools)  # what the ranks agree on
    plans = [plan_batches(p, 2048, 16, random.Random(7), count=count) for p in pools]
    for lengths, batches in zip(pools, plans):
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        assert all(len(b) <= 16 and len(b) * max(lengths[i] for i in b) <= 2048 for b in batches)
    a, b = (sizes(p, bs) for p, bs in zip(pools, plans))
    paired = sum(abs(x - y) for x, y in zip(a, b)) / count
    assert len(a) == len(b) == count and paired < 0.03 * sum(a) / count, (paired, sum(a) / count)
    assert plan_batches(pools[0], 2048, 16, random.Random(7), count=count) == plans[0]
    assert plan_batches(pools[0], 2048, 16, random.Random(8), count=count) != plans[0]


def test_shuffled_order_keeps_ranks_paired_and_breaks_length_runs():
    """data.order "shuffled" (segment_order with no runs): every row once, the ranks' batches still paired
    in size (both ranks draw the same permutation of their cost order), and consecutive batches no longer
    follow each other in length: with 4 runs neighbours differ by a few tokens, shuffled by a random pair's
    gap (runs of similar-length steps trained heads worse: docs/MEASUREMENTS.md "the order of the batches")."""
    import random

    from trainer.batching import min_batches, plan_batches

    gen = random.Random(0)
    pools = [[gen.randint(20, 500) for _ in range(256)] for _ in range(2)]
    count = max(min_batches(p, 2048, 4) for p in pools)
    gaps = {}
    for segments in (4, None):
        plans = [plan_batches(p, 2048, 4, random.Random(7), count=count, segments=segments) for p in pools]
        for lengths, batches in zip(pools, plans):
            assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        longest = [[max(p[i] for i in b) for b in bs] for p, bs in zip(pools, plans)]
        paired = sum(abs(x - y) for x, y in zip(*longest)) / count
        assert paired < 0.05 * sum(longest[0]) / count, (segments, paired)
        gaps[segments] = sum(abs(x - y) for x, y in zip(longest[0], longest[0][1:])) / (count - 1)
    assert gaps[4] < 25 and gaps[None] > 100, gaps


def test_batch_order_pairs_similar_flops_across_ranks():
    """Where loss tokens vary per row (their vocab-sized work outweighs the layer on a SmolLM2-shaped
    head), ordering by estimated FLOPs pairs the ranks' batches on work better than padded size does."""
    import random

    from trainer.batching import flops_cost, min_batches, plan_batches

    flops = smollm2_flops()
    assert flops.per_token == 6 * (3 * 576 * 576 + 7 * (2 * 576 * 15 * 64 + 576 * 576 + 3 * 576 * 1536))
    assert flops.batch(2, 10, 5) == 20 * (flops.per_token + flops.per_token_key * 5) + 5 * (
        7 * 6 * 576 * 8192 + 2 * 576 * 49152)
    gen = random.Random(0)
    pools = []
    for _ in range(2):
        lengths = [gen.choice([gen.randint(8, 60), gen.randint(60, 400)]) for _ in range(256)]
        pools.append((lengths, [int(n * gen.uniform(0.05, 0.95)) for n in lengths]))
    cost = flops_cost(flops)
    count = max(min_batches(lengths, 2048, 16) for lengths, _ in pools)

    def paired_gap(by_flops: bool) -> float:
        costs = []
        for lengths, loss in pools:
            plan = plan_batches(lengths, 2048, 16, random.Random(7), loss, cost if by_flops else None, count)
            assert sorted(i for b in plan for i in b) == list(range(len(lengths)))
            costs.append([cost(len(b), max(lengths[i] for i in b), sum(loss[i] for i in b)) for b in plan])
        n = min(map(len, costs))
        return sum(abs(x - y) for x, y in zip(costs[0][:n], costs[1][:n])) / n

    assert paired_gap(True) < 0.6 * paired_gap(False), (paired_gap(True), paired_gap(False))


def test_pool_planned_into_exactly_the_agreed_count():
    """Every rank plans the count the ranks agreed on (the most any pool needs): exactly that many batches,
    each row once, within the budgets, the costliest no costlier than the fewest-batches plan's; a count
    the pool cannot fill is refused naming the split."""
    import random

    from trainer.batching import balanced_groups, min_batches

    gen = random.Random(1)
    lengths = [gen.randint(5, 500) for _ in range(100)]
    loss = [n // 2 for n in lengths]
    fewest = min_batches(lengths, 2048, 16)
    cost = lambda rows, longest, tokens: rows * longest + 3 * tokens  # noqa: E731
    for count in (fewest, fewest + 3, 100):
        groups = balanced_groups(lengths, loss, count, 2048, 16, cost)
        assert len(groups) == count and sorted(i for g in groups for i in g) == list(range(100))
        assert all(len(g) <= 16 and len(g) * max(lengths[i] for i in g) <= 2048 for g in groups)
    worst = [max(cost(len(g), max(lengths[i] for i in g), sum(loss[i] for i in g)) for g in
                 balanced_groups(lengths, loss, c, 2048, 16, cost)) for c in (fewest, fewest + 3)]
    assert worst[1] <= worst[0]
    with pytest.raises(ValueError, match="unequal rows"):
        balanced_groups(lengths, loss, 101, 2048, 16, cost)
    with pytest.raises(ValueError, match="unequal rows"):
        balanced_groups(lengths, loss, fewest - 1, 2048, 16, cost)


def test_balance_swaps_even_out_the_ranks_work():
    """Rows traded between ranks make their pools' costs equal within 0.1% (here 10-60% apart before),
    each rank keeps its row count, every row lands on exactly one rank; balanced pools trade nothing."""
    import random

    from trainer.batching import balance_swaps

    gen = random.Random(2)
    for world in (2, 3, 4):
        costs = [[gen.uniform(1, 10) + 1.5 * r for _ in range(64)] for r in range(world)]
        totals = [sum(c) for c in costs]
        assert (max(totals) - min(totals)) / (sum(totals) / world) > 0.1
        place = balance_swaps(costs, 32)
        assert [len(p) for p in place] == [64] * world
        assert sorted(x for p in place for x in p) == [(r, k) for r in range(world) for k in range(64)]
        after = [sum(costs[r][k] for r, k in p) for p in place]
        assert (max(after) - min(after)) / (sum(after) / world) < 1e-3, after
    same = [[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]]
    assert balance_swaps(same, 5) == [[(0, 0), (0, 1), (0, 2)], [(1, 0), (1, 1), (1, 2)]]


def test_pools_planned_together_match_each_steps_work():
    """plan_steps: the ranks' pools planned as one give every rank the same number of batches, each row
    exactly once within the budgets, and at every step batches whose estimated work differs less than the
    per-rank plans of traded pools (the "pools" balance), so the epoch is shorter; the plan is a pure
    function of its inputs."""
    import random

    from trainer.batching import balance_swaps, flops_cost, min_batches, plan_batches, plan_steps

    cost = flops_cost(smollm2_flops())
    gen = random.Random(3)
    for world in (2, 3):
        lengths = [[gen.choice([gen.randint(20, 150), gen.randint(150, 900)]) for _ in range(90)] for _ in range(world)]
        loss = [[int(n * gen.uniform(0.1, 0.9)) for n in p] for p in lengths]

        def step_costs(batches):  # batches[r][step] -> [(source rank, index)]
            return [[cost(len(b), max(lengths[s][k] for s, k in b), sum(loss[s][k] for s, k in b)) for b in bs]
                    for bs in batches]

        plan = plan_steps(lengths, loss, 2048, 16, random.Random(5), cost)
        assert plan == plan_steps(lengths, loss, 2048, 16, random.Random(5), cost)
        assert len({len(p) for p in plan}) == 1
        assert sorted(x for p in plan for b in p for x in b) == [(r, k) for r in range(world) for k in range(90)]
        assert all(len(b) <= 16 and len(b) * max(lengths[s][k] for s, k in b) <= 2048 for p in plan for b in p)
        joint = step_costs(plan)
        # the "pools" balance on the same rows: trades, then every rank plans the agreed count
        place = balance_swaps([[cost(1, n, t) for n, t in zip(a, b)] for a, b in zip(lengths, loss)], 11)
        count = max(min_batches([lengths[s][k] for s, k in held], 2048, 16) for held in place)
        alone = []
        for held in place:
            lens, lt = [lengths[s][k] for s, k in held], [loss[s][k] for s, k in held]
            alone.append([[held[i] for i in b] for b in plan_batches(lens, 2048, 16, random.Random(5), lt, cost, count)])
        waits = [sum(max(c) - min(c) for c in zip(*step_costs(p))) / sum(map(sum, step_costs(p)))
                 for p in (plan, alone)]
        assert waits[0] < 0.7 * waits[1], waits  # 1.1% vs 2.6% of the work (2 ranks), 1.5% vs 2.5% (3)
        # the epoch's time, each step as long as its costliest batch: 3-4% shorter
        assert sum(max(c) for c in zip(*joint)) < 0.98 * sum(max(c) for c in zip(*step_costs(alone)))


def test_faster_rank_gets_more_work_each_step():
    """plan_steps with measured speeds: every row once within the budgets, equal batch counts, and over 12
    random pools the epoch (each step as long as its slowest rank: cost / speed) is >= 2.5% shorter than
    the equal-work plan's under the same speeds, never longer; speed_shares' deadband and clamp."""
    import random

    from trainer.batching import flops_cost, plan_steps, speed_shares

    cost, gen = flops_cost(smollm2_flops()), random.Random(7)
    speeds = [1.06, 0.94]  # the 6% gap between two ranks measured on a 2-core box (ARCHITECTURE.md §10)
    gains = []
    for _ in range(12):
        lengths = [[min(1024, int(gen.lognormvariate(5.2, 0.6)) + 20) for _ in range(90)] for _ in range(2)]
        loss = [[int(n * gen.uniform(0.2, 0.8)) for n in p] for p in lengths]
        flat = {(r, k): (lengths[r][k], loss[r][k]) for r in range(2) for k in range(90)}

        def epoch(plan):
            return sum(max(cost(len(b), max(flat[x][0] for x in b), sum(flat[x][1] for x in b)) / speeds[r]
                           for r, b in enumerate(step)) for step in zip(*plan))

        fast = plan_steps(lengths, loss, 2048, 16, random.Random(1), cost, speeds=speeds)
        equal = plan_steps(lengths, loss, 2048, 16, random.Random(1), cost)
        assert fast == plan_steps(lengths, loss, 2048, 16, random.Random(1), cost, speeds=speeds)
        assert len(fast[0]) == len(fast[1]) == len(equal[0])
        assert sorted(x for p in fast for b in p for x in b) == sorted(flat)
        assert all(len(b) <= 16 and len(b) * max(flat[x][0] for x in b) <= 2048 for p in fast for b in p)
        gains.append(1 - epoch(fast) / epoch(equal))
    assert min(gains) >= 0 and sum(gains) / len(gains) >= 0.025, gains
    assert speed_shares([2.0, 1.0]) == [1.333, 0.667]
    assert speed_shares([1.0, 1.005]) is None and speed_shares([1.0, None]) is None
    assert speed_shares([10.0, 1.0, 1.0]) == [2.0, 0.5, 0.5]  # clamped
    assert speed_shares([1.0, 5.47]) == [0.5, 1.5]  # clamped, mean kept 1 (a CI run saw [0.5, 1.691])
    assert speed_shares([1.0, 1.0, 9.0]) == [0.5, 0.5, 2.0]
    assert speed_shares([1.0, 2.0, 30.0, 1.0]) == [0.5, 1.0, 2.0, 0.5]  # the unclipped rank takes up the slack


class ThreadPeers:
    """Two ranks of MicroBatches as threads of this process: agree / gather through a barrier."""

    def __init__(self, rank: int, hub: dict):
        self.rank, self.world, self.hub = rank, 2, hub

    def _exchange(self, obj):
        self.hub["slots"][self.rank] = obj
        self.hub["barrier"].wait()
        got = list(self.hub["slots"])
        self.hub["barrier"].wait()
        return got

    def agree(self, dry: bool, need: int):
        got = self._exchange((dry, need))
        return any(g[0] for g in got), max(g[1] for g in got)

    def gather(self, obj):
        return self._exchange(obj)


def test_measured_speeds_are_recorded_and_replayed():
    """Two ranks (threads) stream 3 pools each: pools after the first are planned with the ranks' measured
    speeds (rank 0, 1.1x faster, gets more of the estimated work), every row is trained once, and a second
    epoch run handed the recorded speeds plans the same batches although its ranks now measure the
    opposite speeds (what a resumed run does)."""
    import random
    import threading

    import numpy as np

    from trainer.data import MicroBatches, RankPace, batch_cost

    gen = random.Random(2)
    rows = [[{"id": f"{r}-{k}", "input_ids": np.zeros(n := gen.randint(30, 400), np.int64),
              "loss_mask": (np.arange(n) % gen.randint(2, 5) == 0).astype(np.int64),
              "aux_hidden": b"", "last_hidden": b""} for k in range(96)] for r in range(2)]

    def run(rates: list[float], speeds: dict) -> list[list[list[dict]]]:
        hub = {"slots": [None, None], "barrier": threading.Barrier(2)}
        out: list[list] = [[], []]

        def rank(r: int):
            batches = iter([{k: [row[k] for row in rows[r][i:i + 8]] for k in rows[r][0]}
                            for i in range(0, 96, 8)])
            pace = RankPace()
            stream = MicroBatches(batches, 1024, 8, 32, 0, 0, smollm2_flops(), ThreadPeers(r, hub),
                                  "steps", pace, speeds)
            while (b := stream.next_batch()) is not None:
                out[r].append(b)
                w = batch_cost(stream, b)
                pace.add(w, w / rates[r])  # seconds as if this rank ran at rates[r]
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        return out

    speeds: dict = {}
    first = run([1.1, 1.0], speeds)
    assert sorted(speeds) == ["0", "1", "2"] and speeds["0"] is None
    assert speeds["1"] == speeds["2"] == [1.048, 0.952]
    ids = sorted(row["id"] for rank in first for b in rank for row in b)
    assert ids == sorted(row["id"] for r in rows for row in r)
    stream = MicroBatches(iter([]), 1024, 8, 32, 0, 0, smollm2_flops())
    later = [sum(batch_cost(stream, b) for b in rank[len(rank) // 3:]) for rank in first]
    assert 1.04 < later[0] / later[1] < 1.14, later  # 1.058 seen: the token budget caps the faster batch
    again = run([1.0, 1.1], dict(speeds))
    assert [[[row["id"] for row in b] for b in rank] for rank in again] == \
        [[[row["id"] for row in b] for b in rank] for rank in first]


def test_collate_supervises_the_answers_or_every_real_token():
    """loss_on "assistant" keeps each row's own mask; "all" marks every real token and never the padding."""
    import torch

    from pipeline.codec import to_bytes
    from trainer.data import collate

    h = 4
    rows = [{"input_ids": list(range(n)), "loss_mask": mask,
             "aux_hidden": to_bytes(torch.randn(n, 3 * h), "bf16", groups=3),
             "last_hidden": to_bytes(torch.randn(n, h), "bf16")}
            for n, mask in ((5, [0, 0, 1, 1, 0]), (3, [0, 1, 1]))]
    own = collate(rows, "bf16", h)["loss_mask"]
    every = collate(rows, "bf16", h, loss_on="all")["loss_mask"]
    assert own.tolist() == [[0, 0, 1, 1, 0], [0, 1, 1, 0, 0]]
    assert every.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
