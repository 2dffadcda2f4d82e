"""Micro-batch planning (trainer/batching.py, pure) and MicroBatches' ranks, without Ray: rank-aligned
batch order, cost-balanced pools, the ranks' pools planned together (docs/ARCHITECTURE.md §7); the loss
mask collate builds."""
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
    """Every row once, the ranks' batches still paired in size (both ranks draw the same permutation of
    their cost order), and consecutive batches do not follow each other in length (runs of similar-length
    steps trained heads worse)."""
    import random

    from trainer.batching import min_batches, plan_batches

    gen = random.Random(0)
    pools = [[gen.randint(20, 500) for _ in range(256)] for _ in range(2)]
    count = max(min_batches(p, 2048, 4) for p in pools)
    plans = [plan_batches(p, 2048, 4, random.Random(7), count=count) for p in pools]
    for lengths, batches in zip(pools, plans):
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    longest = [[max(p[i] for i in b) for b in bs] for p, bs in zip(pools, plans)]
    paired = sum(abs(x - y) for x, y in zip(*longest)) / count
    assert paired < 0.05 * sum(longest[0]) / count, paired
    gap = sum(abs(x - y) for x, y in zip(longest[0], longest[0][1:])) / (count - 1)
    assert gap > 100, gap


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


def test_pools_planned_together_match_each_steps_work():
    """plan_steps: the ranks' pools planned as one give every rank the same number of batches, each row
    exactly once within the budgets, and at every step batches whose estimated work differs less than
    each rank's own plan of its pool, so the epoch is shorter; the plan is a pure function of its inputs."""
    import random

    from trainer.batching import flops_cost, min_batches, plan_batches, plan_steps

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
        # each rank planning its own pool into the count the ranks agree on
        count = max(min_batches(p, 2048, 16) for p in lengths)
        alone = [[[(r, i) for i in b] for b in plan_batches(lengths[r], 2048, 16, random.Random(5), loss[r], cost,
                                                             count)] for r in range(world)]
        waits = [sum(max(c) - min(c) for c in zip(*step_costs(p))) / sum(map(sum, step_costs(p)))
                 for p in (plan, alone)]
        assert waits[0] < 0.7 * waits[1], waits
        # the epoch's time, each step as long as its costliest batch
        assert sum(max(c) for c in zip(*joint)) < 0.98 * sum(max(c) for c in zip(*step_costs(alone)))


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


def test_two_ranks_plan_their_pools_together_and_replay():
    """Two ranks (threads) stream 3 pools each: every row is trained exactly once, both ranks take the same
    number of steps, and a second run plans the same batches (what a resumed run replays)."""
    import random
    import threading

    import numpy as np

    from trainer.data import MicroBatches

    gen = random.Random(2)
    rows = [[{"id": f"{r}-{k}", "input_ids": np.zeros(n := gen.randint(30, 400), np.int64),
              "loss_mask": (np.arange(n) % gen.randint(2, 5) == 0).astype(np.int64),
              "aux_hidden": b"", "last_hidden": b""} for k in range(96)] for r in range(2)]

    def run() -> list[list[list[dict]]]:
        hub = {"slots": [None, None], "barrier": threading.Barrier(2)}
        out: list[list] = [[], []]

        def rank(r: int):
            batches = iter([{k: [row[k] for row in rows[r][i:i + 8]] for k in rows[r][0]}
                            for i in range(0, 96, 8)])
            stream = MicroBatches(batches, 1024, 8, 32, 0, 0, smollm2_flops(), ThreadPeers(r, hub))
            while (b := stream.next_batch()) is not None:
                out[r].append(b)
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        return out

    first = run()
    ids = sorted(row["id"] for rank in first for b in rank for row in b)
    assert ids == sorted(row["id"] for r in rows for row in r)
    assert len(first[0]) == len(first[1]) > 0
    again = run()
    assert [[[row["id"] for row in b] for b in rank] for rank in again] == \
        [[[row["id"] for row in b] for b in rank] for rank in first]


def test_collate_keeps_each_rows_answer_mask():
    """The loss mask is each row's own (its answers), zero on the padding."""
    import torch

    from pipeline.codec import to_bytes
    from trainer.data import collate

    h = 4
    rows = [{"input_ids": list(range(n)), "loss_mask": mask,
             "aux_hidden": to_bytes(torch.randn(n, 3 * h), "bf16", groups=3),
             "last_hidden": to_bytes(torch.randn(n, h), "bf16")}
            for n, mask in ((5, [0, 0, 1, 1, 0]), (3, [0, 1, 1]))]
    own = collate(rows, "bf16", h)["loss_mask"]
    assert own.tolist() == [[0, 0, 1, 1, 0], [0, 1, 1, 0, 0]]
