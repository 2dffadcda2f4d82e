"""Verify attention that rounds like the 1-token steps it replaces (the lean target's exact verify,
infer/cpu/lean.py).

Greedy speculative decoding is lossless only if each verified row's logits are the ones the target
computes when it decodes that row's path one token at a time, as HF generate does. In bf16, SDPA's CPU
kernel rounds a row of a masked multi-row call differently from that row's own unmasked 1-token call, and
greedy output changes. So a verify makes one SDPA call per key count: the rows that see that many keys
are the batch, each with exactly its own keys in position order (the shared prefix expanded, then its own
ancestors), as its 1-token step saw them. Padding rows with masked keys up to a longer row's count kept
the bits on random probes within blocks of 16 keys, but not always on real activations (SmolLM2 on an
AVX-512 EPYC: 2 rows of ~580 in one decode), so no row is padded.

A group's rows share the committed prefix and differ in a few keys after it. Built per call, each row's
keys are a copy of the whole prefix plus its own (a verify of 16 rows after 450 keys copied ~5 MB a layer
on SmolLM2). `PrefixCopies` keeps R copies of each layer's committed prefix beside the cache instead,
brought up to date by the few slots committed since the last verify; a group of rows then writes only its
own keys after the prefix and attends over a view, which reads like the 1-token step's view of the cache.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from infer.cpu.scripted import script


class PathGroups:
    """The rows of a verify mask [1, 1, n, N] (bool keep, or additive 0 / -inf) grouped by how many keys
    they see, computed once per forward. Each group is (first, stop, rows, lead, tail, c): rows
    [first, stop) when consecutive (a tree in creation order, rows None) else the index tensor rows; every
    row sees c keys, slots [0, lead) first (the committed prefix: expanded, not gathered), then tail
    [g * (c - lead)], the rest of each row's keys in position order. `in_order`: the groups' rows are
    consecutive slices tiling 0..n in order, so the outputs can be concatenated."""

    def __init__(self, mask: torch.Tensor, key_positions: torch.Tensor):
        visible = mask[0, 0] if mask.dtype == torch.bool else mask[0, 0] == 0
        counts = visible.sum(-1)
        self.groups, end, self.in_order = [], 0, True
        for c in counts.unique().tolist():
            rows = (counts == c).nonzero().flatten()
            first, g = int(rows[0]), len(rows)
            # each row's keys by position, the order its 1-token step saw them
            rank = torch.where(visible[rows], key_positions[None], key_positions.max() + 1)
            keys = rank.argsort(dim=1, stable=True)[:, :c]
            shared = (keys == torch.arange(c, device=keys.device)).all(0)
            lead = c if bool(shared.all()) else int((~shared).nonzero()[0])
            if int(rows[-1]) - first == g - 1:
                self.in_order &= first == end
                end, rows = first + g, None
            else:
                self.in_order = False
            self.groups.append((first, first + g, rows, lead, keys[:, lead:].flatten(), c))


class PrefixCopies:
    """R copies of every layer's committed K/V side by side, [layers, 2, R, kv_heads, capacity, D], one per
    sequence beside its cache (infer/cpu/lean.py's StaticKV): slots [0, synced) of each copy equal the
    cache's. A verify brings them up to its start (the slots committed since the last one), then each group
    of up to R rows writes its own keys after the prefix (module docstring)."""

    def __init__(self, kv: torch.Tensor, copies: int = 4):
        L, _, kvh, cap, D = kv.shape
        self.buf = kv.new_empty((L, 2, copies, kvh, cap, D))
        self.synced = 0

    def fit(self, capacity: int) -> None:
        """Grow to the cache's capacity, keeping the synced slots."""
        cap = self.buf.shape[4]
        if capacity > cap:
            pad = self.buf.new_empty((*self.buf.shape[:4], capacity - cap, self.buf.shape[5]))
            self.buf = torch.cat([self.buf, pad], dim=4)

    def cut(self, length: int) -> None:
        """The cache was cut to `length` slots: later slots no longer hold what was synced."""
        self.synced = min(self.synced, length)


def path_attention(q: torch.Tensor, kv: torch.Tensor, paths: PathGroups, scale: float,
                   copies: Optional[torch.Tensor] = None, synced: int = 0, start: int = 0) -> torch.Tensor:
    """q [1, heads, n, D]; kv [2, kv_heads, N, D] (this layer's K and V) -> [n, heads, 1, D]: each row
    attends to its visible keys as its 1-token step does (module docstring), one SDPA call per group (per
    R rows with `copies`). copies: this layer's `PrefixCopies.buf` row [2, R, kv_heads, capacity, D],
    synced to `synced` slots; start: the committed prefix every row sees first (slots [0, start))."""
    return _path_attention(q, kv, paths.groups, paths.in_order, scale, copies, synced, start)


@script
def _path_attention(q: torch.Tensor, kv: torch.Tensor,
                    groups: List[Tuple[int, int, Optional[torch.Tensor], int, torch.Tensor, int]],
                    in_order: bool, scale: float, copies: Optional[torch.Tensor], synced: int,
                    start: int) -> torch.Tensor:
    """path_attention in TorchScript: the same ATen calls without a Python dispatch per op."""
    kvh, D = kv.shape[1], kv.shape[3]
    rows_first = q[0].transpose(0, 1).unsqueeze(2)  # [n, heads, 1, D], a view
    if copies is not None and synced < start:  # the slots committed since the last verify
        copies[:, :, :, synced:start] = kv[:, None, :, synced:start]
    outs: List[torch.Tensor] = []
    for first, stop, rows, lead, tail, c in groups:
        qg = rows_first[first:stop] if rows is None else rows_first.index_select(0, rows)
        g = qg.shape[0]
        if copies is not None and lead >= start and (lead < c or g > 1):
            own = kv.index_select(2, tail).view(2, kvh, g, c - lead, D).transpose(1, 2)
            R = copies.shape[1]
            parts: List[torch.Tensor] = []
            for s in range(0, g, R):
                e = min(g, s + R)
                view = copies[:, : e - s]  # [2, rows, kv_heads, capacity, D]
                view[:, :, :, start:lead] = kv[:, None, :, start:lead]
                view[:, :, :, lead:c] = own[:, s:e]
                parts.append(F.scaled_dot_product_attention(qg[s:e], view[0, :, :, :c], view[1, :, :, :c],
                                                            scale=scale, enable_gqa=True))
            outs.append(parts[0] if len(parts) == 1 else torch.cat(parts))
            continue
        both = kv[:, None, :, :lead]  # [2, 1, kv_heads, lead, D]
        if lead < c or g > 1:  # K and V of the group's rows: [2, rows, kv_heads, c, D]
            own = kv.index_select(2, tail).view(2, kvh, g, c - lead, D).transpose(1, 2)
            both = torch.cat([both.expand(2, g, kvh, lead, D), own], dim=3)
        outs.append(F.scaled_dot_product_attention(qg, both[0], both[1], scale=scale, enable_gqa=True))
    if in_order:
        return torch.cat(outs)
    out = torch.empty_like(rows_first)
    for i in range(len(groups)):
        first, stop, rows, lead, tail, c = groups[i]
        if rows is None:
            out[first:stop] = outs[i]
        else:
            out.index_copy_(0, rows, outs[i])
    return out
