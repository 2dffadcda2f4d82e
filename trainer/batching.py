"""Micro-batch planning as pure functions: rows of a pool grouped by length into cost-balanced padded
batches, their rank-aligned random order, and the ranks' pools planned together into steps of matched work
(docs/ARCHITECTURE.md §7). `trainer/data.py` runs them on the rows each rank streams.
"""
from __future__ import annotations

import math
import random
from typing import Callable

from pipeline.buckets import length_buckets
from trainer.cost import StepFlops

GroupCost = Callable[[int, int, int], float]  # (rows, longest row, loss tokens) -> estimated work


def padded_cost(rows: int, longest: int, _loss_tokens: int) -> float:
    return float(rows * longest)


def flops_cost(flops: StepFlops) -> GroupCost:
    """A batch's estimated FLOPs (trainer/cost.py): on a SmolLM2-shaped head the vocab-sized work on loss
    positions outweighs the layer, so padded size alone pairs batches whose work differs by 2x."""
    return flops.batch


def min_batches(lengths: list[int], max_tokens: int, max_rows: int) -> int:
    """The fewest batches a pool fits in under the token and row budgets (greedy over sorted lengths is
    optimal for contiguous groups)."""
    return len(length_buckets(lengths, max_tokens, max_rows))


def balanced_groups(lengths: list[int], loss_tokens: list[int], count: int, max_tokens: int, max_rows: int,
                    cost: GroupCost = padded_cost) -> list[list[int]]:
    """Pure: exactly `count` batches of a pool (min_batches <= count <= rows), each a run of the rows sorted
    by length (ties by index) within the budgets, with the costliest batch as cheap as such runs allow:
    a bisection on the cost cap, then the costliest batches split until there are `count`."""
    n, fewest = len(lengths), min_batches(lengths, max_tokens, max_rows)
    if not fewest <= count <= n:
        raise ValueError(f"cannot plan {n} rows into {count} batches (need {fewest} to {n}): the ranks' "
                         f"splits hold unequal rows")
    order = sorted(range(n), key=lambda i: (lengths[i], i))
    prefix = [0]
    for i in order:
        prefix.append(prefix[-1] + loss_tokens[i])

    def run_cost(a: int, b: int) -> float:  # rows order[a:b]; the longest is the last
        return cost(b - a, lengths[order[b - 1]], prefix[b] - prefix[a])

    def fits(a: int, b: int, cap: float) -> bool:
        return b - a <= max_rows and (b - a) * lengths[order[b - 1]] <= max_tokens and run_cost(a, b) <= cap

    def greedy(cap: float) -> list[tuple[int, int]]:
        runs, a = [], 0
        while a < n:
            b = a + 1
            while b < n and fits(a, b + 1, cap):
                b += 1
            runs.append((a, b))
            a = b
        return runs

    lo, hi = max(run_cost(i, i + 1) for i in range(n)), run_cost(0, n)
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if len(greedy(mid)) <= count else (mid, hi)
    runs = greedy(hi)
    while len(runs) < count:  # split the costliest run of 2+ rows where its halves' larger cost is least
        a, b = max((r for r in runs if r[1] - r[0] > 1), key=lambda r: run_cost(*r))
        cut = min(range(a + 1, b), key=lambda c: max(run_cost(a, c), run_cost(c, b)))
        i = runs.index((a, b))
        runs[i:i + 1] = [(a, cut), (cut, b)]
    return [order[a:b] for a, b in runs]


def plan_batches(lengths: list[int], max_tokens: int, max_rows: int, rng: random.Random,
                 loss_tokens: list[int] | None = None, cost: GroupCost | None = None,
                 count: int | None = None) -> list[list[int]]:
    """Pure: indices of a pool grouped by length into `count` batches (default: the fewest that fit) of
    balanced `cost` (`balanced_groups`), sorted by cost and shuffled by rng. Ranks that plan the same count
    with the same rng hold, at a given step, batches from the same place in their own cost order."""
    loss_tokens = loss_tokens if loss_tokens is not None else [0] * len(lengths)
    cost = cost or padded_cost
    count = count or min_batches(lengths, max_tokens, max_rows)
    batches = balanced_groups(lengths, loss_tokens, count, max_tokens, max_rows, cost)

    batches.sort(key=lambda b: group_cost(b, lengths, loss_tokens, cost))  # stable: ties keep length order
    rng.shuffle(batches)
    return batches


def group_cost(group: list[int], lengths: list[int], loss_tokens: list[int], cost: GroupCost) -> float:
    return cost(len(group), max(lengths[i] for i in group), sum(loss_tokens[i] for i in group))


def plan_steps(lengths: list[list[int]], loss_tokens: list[list[int]], max_tokens: int, max_rows: int,
               rng: random.Random, cost: GroupCost = padded_cost) -> list[list[list[tuple[int, int]]]]:
    """Pure: every rank's pool planned together, so that at each step the ranks finish their batches at
    nearly the same time. The union of the pools (lengths[r], loss_tokens[r]: rank r's rows) is cut by
    `balanced_groups` into world x count batches, count = the fewest per rank that fit the budgets; sorted by
    cost, each `world` neighbours make one step. In a step the batches go to the ranks that hold most of
    their rows (the fewest rows move), and rng shuffles the steps. Returns plan[r][step]: rank r's batch as
    (source rank, index in that rank's pool) pairs. Every rank computes the same plan."""
    world = len(lengths)
    rows = [(r, k) for r in range(world) for k in range(len(lengths[r]))]
    flat_len = [lengths[r][k] for r, k in rows]
    flat_loss = [loss_tokens[r][k] for r, k in rows]
    count = min(math.ceil(min_batches(flat_len, max_tokens, max_rows) / world), len(rows) // world)
    groups = balanced_groups(flat_len, flat_loss, world * count, max_tokens, max_rows, cost)
    ordered = sorted(groups, key=lambda g: group_cost(g, flat_len, flat_loss, cost))
    steps = [ordered[i * world:(i + 1) * world] for i in range(count)]
    rng.shuffle(steps)
    plan = [step_to_ranks(step, rows, world) for step in steps]  # [step][rank] -> row indices
    return [[[rows[i] for i in m[r]] for m in plan] for r in range(world)]


def step_to_ranks(step: list[list[int]], rows: list[tuple[int, int]], world: int) -> list[list[int]]:
    """Pure: a step's batches -> rank r's batch at [r]: greedily, the largest overlap of a batch with a
    rank's own rows first (the fewest rows move)."""
    mine: list[list[int]] = [[] for _ in range(world)]
    home = [[sum(rows[i][0] == r for i in g) for r in range(world)] for g in step]
    free_groups, free_ranks = set(range(world)), set(range(world))
    while free_groups:
        g, r = max(((g, r) for g in free_groups for r in free_ranks),
                   key=lambda gr: (home[gr[0]][gr[1]], -gr[0], -gr[1]))
        mine[r] = step[g]
        free_groups.discard(g)
        free_ranks.discard(r)
    return mine
