"""Length bucketing, the one rule for every padded batch (capture forwards, training micro-batches).

Rows are sorted by length and cut into groups whose padded size (rows x the longest row) stays within a
token budget, with at least one row per group (a row longer than the budget goes alone).
"""
from __future__ import annotations


def length_buckets(lengths: list[int], max_tokens: int, max_rows: int | None = None,
                   longest_first: bool = False) -> list[list[int]]:
    """Pure: indices grouped by length, each group padded <= max_tokens and <= max_rows rows.
    Ties keep index order; `longest_first` puts the longest rows first (capture), else shortest first."""
    if longest_first:
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    else:
        order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    groups, cur, width = [], [], 0
    for i in order:
        w = max(width, lengths[i])
        if cur and (w * (len(cur) + 1) > max_tokens or (max_rows is not None and len(cur) >= max_rows)):
            groups.append(cur)
            cur, w = [], lengths[i]
        cur.append(i)
        width = w
    if cur:
        groups.append(cur)
    return groups
