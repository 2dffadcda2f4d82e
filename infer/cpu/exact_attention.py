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


def path_attention(q: torch.Tensor, kv: torch.Tensor, paths: PathGroups, scale: float) -> torch.Tensor:
    """q [1, heads, n, D]; kv [2, kv_heads, N, D] (this layer's K and V) -> [n, heads, 1, D]: each row
    attends to its visible keys as its 1-token step does (module docstring), one SDPA call per group."""
    return _path_attention(q, kv, paths.groups, paths.in_order, scale)


@script
def _path_attention(q: torch.Tensor, kv: torch.Tensor,
                    groups: List[Tuple[int, int, Optional[torch.Tensor], int, torch.Tensor, int]],
                    in_order: bool, scale: float) -> torch.Tensor:
    """path_attention in TorchScript: the same ATen calls without a Python dispatch per op."""
    kvh, D = kv.shape[1], kv.shape[3]
    rows_first = q[0].transpose(0, 1).unsqueeze(2)  # [n, heads, 1, D], a view
    outs: List[torch.Tensor] = []
    for first, stop, rows, lead, tail, c in groups:
        qg = rows_first[first:stop] if rows is None else rows_first.index_select(0, rows)
        g = qg.shape[0]
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
