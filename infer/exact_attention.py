"""Verify attention that rounds like the 1-token steps it replaces (docs/ARCHITECTURE.md "Exact verify
attention").

Greedy speculative decoding is lossless only if each verified row's logits are the ones the target
computes when it decodes that row's path one token at a time, as HF generate does. In bf16, SDPA's CPU
kernel rounds a row of a masked multi-row call differently from that row's own unmasked 1-token call, and
greedy output changes. Measured rule of the kernel (fp32 accumulation in vectors of `block` lanes,
remainders summed apart): a 1-row call over L keys gives the same bits as one over L' >= L keys with keys
L.. masked, iff L and L' fall in the same block of `block` keys (L // block == L' // block). Keys masked
in the middle, or keys in another order, can change the bits (3 and 17 of 60 prefixes tried). So a
verify runs one SDPA call per block class of rows: each row's keys gathered in position order (the
shared prefix expanded, then its own ancestors), padded with masked keys to the class's longest row, the
rows as the batch. `rounding_block` checks the
rule on this CPU and this head shape once, and falls back to block 1 (one call per key length) if it fails.
"""
from __future__ import annotations

import functools
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from infer.scripted_layer import script


def padded_equals_exact(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: str,
                        block: int, max_len: int = 1100) -> bool:
    """Does padding a 1-row SDPA call with masked keys inside its block of `block` keys keep its bits,
    for every key length up to max_len (crossing the kernel's 512-key splits)? Random data, fixed seed."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, 1, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(1, kv_heads, max_len + block, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(1, kv_heads, max_len + block, head_dim, generator=gen).to(device, dtype)
    for length in range(1, max_len + 1):
        want = F.scaled_dot_product_attention(q, k[:, :, :length], v[:, :, :length], enable_gqa=True)
        end = (length // block + 1) * block - 1  # the last length of this block
        for padded in sorted({length + 1, (length + end) // 2, end} - {length}) if end > length else []:
            keep = torch.arange(padded, device=device) < length
            got = F.scaled_dot_product_attention(q, k[:, :, :padded], v[:, :, :padded],
                                                 attn_mask=keep[None, None, None], enable_gqa=True)
            if not torch.equal(got, want):
                return False
    return True


@functools.cache
def _rounding_block(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: str) -> int:
    for block in (16, 8):
        if padded_equals_exact(heads, kv_heads, head_dim, dtype, device, block):
            return block
    return 1


def rounding_block(heads: int, kv_heads: int, head_dim: int, like: torch.Tensor) -> int:
    """The widest block inside which masked padding keeps a 1-row call's bits here (16, 8, else 1)."""
    return _rounding_block(heads, kv_heads, head_dim, like.dtype, like.device.type)


class PathGroups:
    """The rows of a verify mask [1, 1, n, N] (bool keep, or additive 0 / -inf) grouped by the block class
    of how many keys they see (`block` 1: by the count itself), computed once per forward. Each group is
    (first, stop, rows, lead, tail, pad, c): rows [first, stop) when consecutive (a tree in creation order,
    rows None) else the index tensor rows; every row sees slots [0, lead) (the committed prefix: expanded,
    not gathered); tail
    [g * (c - lead)] the rest of each row's keys in position order, padded with slot 0; pad [g, 1, 1, c]
    (bool keep) masks the padding (None when no row is padded); c the class's longest row. `in_order`:
    the groups' rows are consecutive slices tiling 0..n in order, so the outputs can be concatenated."""

    def __init__(self, mask: torch.Tensor, key_positions: torch.Tensor, block: int = 1):
        visible = mask[0, 0] if mask.dtype == torch.bool else mask[0, 0] == 0
        counts = visible.sum(-1)
        classes = counts // block
        self.groups, end, self.in_order = [], 0, True
        for cls in classes.unique().tolist():
            rows = (classes == cls).nonzero().flatten()
            first, g = int(rows[0]), len(rows)
            own = counts[rows]
            c = int(own.max())
            # each row's keys by position (the order its 1-token steps saw), then padding slots at the end
            rank = torch.where(visible[rows], key_positions[None], key_positions.max() + 1)
            order = rank.argsort(dim=1, stable=True)
            keys = order[:, :c]
            keep = torch.arange(c, device=keys.device)[None] < own[:, None]
            keys = keys.masked_fill(~keep, 0)
            shared = (keys == torch.arange(c, device=keys.device)).all(0) & keep.all(0)
            lead = c if bool(shared.all()) else int((~shared).nonzero()[0])
            if int(rows[-1]) - first == g - 1:
                self.in_order &= first == end
                end, rows = first + g, None
            else:
                self.in_order = False
            pad = None if bool(keep.all()) else keep[:, None, None]
            self.groups.append((first, first + g, rows, lead, keys[:, lead:].flatten(), pad, c))


def path_attention(q: torch.Tensor, kv: torch.Tensor, paths: PathGroups, scale: float) -> torch.Tensor:
    """q [1, heads, n, D]; kv [2, kv_heads, N, D] (this layer's K and V) -> [n, heads, 1, D]: each row
    attends to its visible keys as its 1-token step does (module docstring), one SDPA call per group."""
    return _path_attention(q, kv, paths.groups, paths.in_order, scale)


@script
def _path_attention(q: torch.Tensor, kv: torch.Tensor,
                    groups: List[Tuple[int, int, Optional[torch.Tensor], int, torch.Tensor, Optional[torch.Tensor], int]],
                    in_order: bool, scale: float) -> torch.Tensor:
    """path_attention in TorchScript: the same ATen calls without a Python dispatch per op."""
    kvh, D = kv.shape[1], kv.shape[3]
    rows_first = q[0].transpose(0, 1).unsqueeze(2)  # [n, heads, 1, D], a view
    outs: List[torch.Tensor] = []
    for first, stop, rows, lead, tail, pad, c in groups:
        qg = rows_first[first:stop] if rows is None else rows_first.index_select(0, rows)
        g = qg.shape[0]
        both = kv[:, None, :, :lead]  # [2, 1, kv_heads, lead, D]
        if lead < c or g > 1:  # K and V of the group's rows: [2, rows, kv_heads, c, D]
            own = kv.index_select(2, tail).view(2, kvh, g, c - lead, D).transpose(1, 2)
            both = torch.cat([both.expand(2, g, kvh, lead, D), own], dim=3)
        outs.append(F.scaled_dot_product_attention(qg, both[0], both[1], attn_mask=pad, scale=scale,
                                                   enable_gqa=True))
    if in_order:
        return torch.cat(outs)
    out = torch.empty_like(rows_first)
    for i in range(len(groups)):
        first, stop, rows, lead, tail, pad, c = groups[i]
        if rows is None:
            out[first:stop] = outs[i]
        else:
            out.index_copy_(0, rows, outs[i])
    return out
