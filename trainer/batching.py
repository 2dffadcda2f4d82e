"""Micro-batch planning as pure functions: rows of a pool grouped by length into cost-balanced padded
batches, their rank-aligned order, the ranks' pools planned together into steps of matched work, and the
row swaps that give every rank's pool the same work (docs/ARCHITECTURE.md §10). `trainer/data.py` runs
them on the rows each rank streams.
"""
from __future__ import annotations

import bisect
import math
import random
from typing import Callable

from pipeline.buckets import length_buckets
from trainer.cost import StepFlops

ORDER_SEGMENTS = 4

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
                 loss_tokens: list[int] | None = None, cost: GroupCost | None = None, count: int | None = None,
                 segments: int | None = ORDER_SEGMENTS) -> list[list[int]]:
    """Pure: indices of a pool grouped by length into `count` batches (default: the fewest that fit) of
    balanced `cost` (`balanced_groups`), in a rank-aligned random order. The batches are sorted by cost,
    cut into `segments` runs of equal count, and rng shuffles the runs and flips each one's direction.
    Every rank plans the same count and draws the same rng for the same pool, so at a given step the ranks
    hold batches from the same place in their own cost order: similar work, so neither waits long for the
    other at the gradient all-reduce (ARCHITECTURE.md §10)."""
    loss_tokens = loss_tokens if loss_tokens is not None else [0] * len(lengths)
    cost = cost or padded_cost
    count = count or min_batches(lengths, max_tokens, max_rows)
    batches = balanced_groups(lengths, loss_tokens, count, max_tokens, max_rows, cost)

    batches.sort(key=lambda b: group_cost(b, lengths, loss_tokens, cost))  # stable: ties keep length order
    return segment_order(batches, rng, segments)


def group_cost(group: list[int], lengths: list[int], loss_tokens: list[int], cost: GroupCost) -> float:
    return cost(len(group), max(lengths[i] for i in group), sum(loss_tokens[i] for i in group))


def segment_order(items: list, rng: random.Random, segments: int | None = ORDER_SEGMENTS) -> list:
    """Pure: `items` (sorted by cost) cut into `segments` runs of equal count (None: one run per item, a
    full shuffle); rng shuffles the runs and flips each one's direction. The same rng on every rank gives
    every rank the same order."""
    n = len(items)
    segments = segments or max(1, n)
    runs = [items[n * k // segments:n * (k + 1) // segments] for k in range(segments)]
    rng.shuffle(runs)
    out = []
    for run in runs:
        out += run[::-1] if rng.random() < 0.5 else run
    return out


def plan_steps(lengths: list[list[int]], loss_tokens: list[list[int]], max_tokens: int, max_rows: int,
               rng: random.Random, cost: GroupCost = padded_cost, segments: int | None = ORDER_SEGMENTS,
               speeds: list[float] | None = None) -> list[list[list[tuple[int, int]]]]:
    """Pure: every rank's pool planned together, so that at each step the ranks finish their batches at
    nearly the same time. The union of the pools (lengths[r], loss_tokens[r]: rank r's rows) is cut by
    `balanced_groups` into world x count batches, count = the fewest per rank that fit the budgets; sorted by
    cost, each `world` neighbours make one step. In a step the batches go to the ranks that hold most of
    their rows (the fewest rows move), and the steps take `segment_order`.
    With `speeds` (rank r's work per second, relative; None: all equal) a second plan is made too: each
    `world` neighbours in length order make a step, whose rows have similar lengths, so `weigh_step` can
    trade them until each rank's batch takes the same time (cost-sorted neighbours differ in length, and
    their batches sit at the token budget: few trades fit). The plan whose epoch is shorter (the sum over
    steps of the slowest rank's time) is returned. Returns plan[r][step]: rank r's batch as (source rank,
    index in that rank's pool) pairs. Every rank computes the same plan."""
    world = len(lengths)
    rows = [(r, k) for r in range(world) for k in range(len(lengths[r]))]
    flat_len = [lengths[r][k] for r, k in rows]
    flat_loss = [loss_tokens[r][k] for r, k in rows]
    count = min(math.ceil(min_batches(flat_len, max_tokens, max_rows) / world), len(rows) // world)
    groups = balanced_groups(flat_len, flat_loss, world * count, max_tokens, max_rows, cost)
    drawn = rng.getstate()  # a second plan draws the same step order

    def assign(ordered: list[list[int]]) -> list[list[list[int]]]:  # [step][rank] -> row indices
        rng.setstate(drawn)
        steps = segment_order([ordered[i * world:(i + 1) * world] for i in range(count)], rng, segments)
        return [step_to_ranks(step, rows, world) for step in steps]

    best = assign(sorted(groups, key=lambda g: group_cost(g, flat_len, flat_loss, cost)))
    if speeds is not None:
        weighed = [weigh_step(m, speeds, flat_len, flat_loss, cost, max_tokens, max_rows)
                   for m in assign(groups)]

        def epoch(plan: list[list[list[int]]]) -> float:
            return sum(max(group_cost(g, flat_len, flat_loss, cost) / speeds[r] for r, g in enumerate(m))
                       for m in plan)
        best = min((best, weighed), key=epoch)
    return [[[rows[i] for i in m[r]] for m in best] for r in range(world)]


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


def weigh_step(batches: list[list[int]], speeds: list[float], lengths: list[int], loss_tokens: list[int],
               cost: GroupCost, max_tokens: int, max_rows: int, max_trades: int = 32) -> list[list[int]]:
    """Pure: one step's batches (batches[r]: rank r's row indices) with rows moved or swapped between
    ranks so that the step's time, max over r of cost_r / speeds[r], is as short as single trades make it,
    every batch within the budgets and non-empty. Each trade is the best move of one row or swap of two
    between the rank that finishes last and the one that finishes first (exact batch costs, padding
    included); it stops when no trade shortens that pair."""
    out = [list(b) for b in batches]

    def fits(g: list[int]) -> bool:
        return 0 < len(g) <= max_rows and len(g) * max(lengths[i] for i in g) <= max_tokens

    def secs(g: list[int], r: int) -> float:
        return group_cost(g, lengths, loss_tokens, cost) / speeds[r]

    for _ in range(max_trades):
        times = [secs(g, r) for r, g in enumerate(out)]
        hi, lo = times.index(max(times)), times.index(min(times))
        heavy, light = out[hi], out[lo]
        best, pair = times[hi] * (1 - 1e-9), None
        for i in range(len(heavy)):
            rest = heavy[:i] + heavy[i + 1:]
            for j in [None, *range(len(light))]:  # None: move row i; else swap it with light[j]
                h = rest if j is None else rest + [light[j]]
                lt = light + [heavy[i]] if j is None else light[:j] + light[j + 1:] + [heavy[i]]
                if fits(h) and fits(lt):
                    t = max(secs(h, hi), secs(lt, lo))
                    if t < best:
                        best, pair = t, (h, lt)
        if pair is None:
            break
        out[hi], out[lo] = pair
    return out


def speed_shares(rates: list[float | None], deadband: float = 0.01, clamp: float = 2.0) -> list[float] | None:
    """Pure: the ranks' measured rates (work per second; None: not measured yet) -> relative speeds with
    mean 1, rounded to 3 decimals so a checkpoint replays them exactly; None (plan equal work) when any rank
    has no rate or they differ by less than `deadband`. Shares are proportional to the rates, each clipped
    to [1/clamp, clamp], at the scale that keeps their mean 1: one stalled measurement must not hand a
    rank a tiny batch for a whole pool, nor change the total work planned."""
    if not rates or any(r is None or r <= 0 for r in rates):
        return None

    def shares(a: float) -> list[float]:
        return [min(clamp, max(1 / clamp, a * r)) for r in rates]

    lo, hi = 1 / (clamp * max(rates)), clamp / min(rates)  # all at the lower bound .. all at the upper
    for _ in range(100):  # the mean of the clipped shares rises with the scale a: bisect for mean 1
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if sum(shares(mid)) < len(rates) else (lo, mid)
    rel = shares((lo * hi) ** 0.5)
    if max(rel) / min(rel) < 1 + deadband:
        return None
    return [round(r, 3) for r in rel]


def balance_swaps(costs: list[list[float]], max_swaps: int, tolerance: float = 1e-3) -> list[list[tuple[int, int]]]:
    """Pure: rows traded between ranks so that each rank's pool sums to the same cost, row counts kept.
    Repeatedly the heaviest and the lightest rank trade the pair of rows whose cost difference is nearest
    half their gap (a trade only ever narrows it), until the gap is within `tolerance` of a rank's mean
    total or `max_swaps` trades are made. Returns the placement: placement[r][k] = (rank, index) in the
    input of the row rank r holds at position k."""
    held = [list(c) for c in costs]
    place = [[(r, k) for k in range(len(c))] for r, c in enumerate(costs)]
    mean = sum(map(sum, held)) / max(1, len(held))
    for _ in range(max_swaps):
        totals = [sum(h) for h in held]
        hi = max(range(len(held)), key=totals.__getitem__)
        lo = min(range(len(held)), key=totals.__getitem__)
        gap = totals[hi] - totals[lo]
        trade = best_trade(held[hi], held[lo], gap) if gap > tolerance * mean else None
        if trade is None:
            break
        i, j = trade
        held[hi][i], held[lo][j] = held[lo][j], held[hi][i]
        place[hi][i], place[lo][j] = place[lo][j], place[hi][i]
    return place


def best_trade(heavy: list[float], light: list[float], gap: float) -> tuple[int, int] | None:
    """Pure: (i, j) whose trade leaves the smallest gap |gap - 2 (heavy[i] - light[j])|, or None when no
    trade narrows it."""
    order = sorted(range(len(light)), key=light.__getitem__)
    values = [light[j] for j in order]
    best, left = None, gap
    for i, a in enumerate(heavy):
        at = bisect.bisect_left(values, a - gap / 2)
        for q in (at - 1, at):
            if 0 <= q < len(values) and abs(gap - 2 * (a - values[q])) < left:
                best, left = (i, order[q]), abs(gap - 2 * (a - values[q]))
    return best
