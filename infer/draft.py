"""The draft side: an EAGLE-3 head with its own preallocated KV cache, and tree growth in tensor ops.

A draft element pairs the feature of target position i (fc of the target's aux states, or the draft's
own output standing in for it) with the embedding of the token at i + 1, rotated at position i.
Cache slots [0, committed) hold committed elements; a round's tree elements are written after them
(scratch, overwritten by the next ingest). Nothing grows by concatenation on the hot path.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from infer import cpu
from infer.cpu.fused import extension as fused_extension
from infer.cpu.packed import NotPacked, PackedLinear, with_packed_linears
from infer.cpu.scripted import draft_inputs, draft_outputs
from infer.round_cost import RoundPlan, sized_width
from infer.tree import Tree
from infer.tree_tensor import CandidateTable, finalize_tensor, rerank_tensor
from trainer.head import Eagle3Head


class DraftCache:
    """K/V of the head's one attention layer, [1, kv_heads, capacity, head_dim], written at slots.
    Capacity doubles when a write would overflow (rare: it is kept across requests)."""

    def __init__(self, kv_heads: int, head_dim: int, like: torch.Tensor, capacity: int = 512):
        self.k = like.new_zeros((1, kv_heads, capacity, head_dim))
        self.v = torch.zeros_like(self.k)
        self.committed = 0

    def reserve(self, end: int) -> None:
        if end > self.k.shape[2]:
            grow = max(end, 2 * self.k.shape[2]) - self.k.shape[2]
            pad = self.k.new_zeros((*self.k.shape[:2], grow, self.k.shape[3]))
            self.k, self.v = torch.cat([self.k, pad], dim=2), torch.cat([self.v, pad], dim=2)

    def write(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        end = slot + k.shape[2]
        self.reserve(end)
        self.k[:, :, slot:end] = k
        self.v[:, :, slot:end] = v

    def upto(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[:, :, :end], self.v[:, :, :end]


class DraftRunner:
    """The EAGLE-3 head on its path (infer/cpu/__init__.py): its own modules (cpu_path generic), or as far
    up packed, scripted and fused as this machine's probes allow; `path` says which and why."""

    def __init__(self, head: Eagle3Head, embed: torch.Tensor, cpu_path: str = "auto"):
        self.head = head.eval()
        self.embed = embed
        attn = head.midlayer.self_attn
        self.cache = DraftCache(attn.kv_heads, attn.head_dim, embed)
        # What `pack`, `script` and `fuse` set: the head with oneDNN-packed linears (a copy), the scripted
        # halves' arguments, the C++ halves. None: the modules' step / the TorchScript halves.
        self.script_args = self.fused = None
        self.path = cpu.choose_draft(self, cpu_path)
        self.level_logits: list[torch.Tensor] = []  # the last tree's draft logits per level (tests read it)
        self.levels = 0  # draft levels the last tree grew (the root's children count as one)
        self.expected = 0.0  # a sized tree's expected accepted tokens (round_cost.sized_width)
        self.table: CandidateTable | None = None  # the last tree's candidates, kept or not

    def reset(self) -> None:
        self.cache.committed = 0

    @property
    def cached(self) -> int:
        return self.cache.committed

    def _step(self, h: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, slot: int,
              mask: torch.Tensor, last_only: bool = False):
        """m elements written at cache slots [slot, slot + m), attending to slots [0, slot + m) under
        mask [m, slot + m] bool. -> (states [m, H] (the head's `finish`), logits [m, Vd], or [1, Vd] for
        the last element when last_only)."""
        emb = F.embedding(tokens, self.embed)[None]
        end = slot + len(tokens)
        if self.script_args is None:
            q, k, v = self.head.qkv(h[None], emb, positions[None])
        else:
            inputs, outputs = self.script_args
            cos, sin = self.head.rotary(emb, positions[None])
            if self.fused is not None:  # writes k and v into the cache itself
                self.cache.reserve(end)
                q = self.fused.draft_inputs(h[None], emb, *inputs[:4], cos, sin, *inputs[4:], self.cache.k[0],
                                            self.cache.v[0], slot)
            else:
                q, k, v = draft_inputs(h[None], emb, *inputs[:4], cos[:, :, None], sin[:, :, None],
                                       *inputs[4:])
        if self.fused is None:  # the fused draft_inputs wrote them already
            self.cache.write(slot, k, v)
        kk, vv = self.cache.upto(end)
        out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask[None, None], enable_gqa=True)
        if self.script_args is not None:
            halves = draft_outputs if self.fused is None else self.fused.draft_outputs
            x, logits = halves(h[None], out, *outputs, last_only)
            return x[0], logits[0]
        x = self.head.finish(h[None], out)[0]
        return x, self.head.logits(x[-1:] if last_only else x)

    def pack(self) -> str | None:
        """Pack the head's linears for oneDNN (a copy; the projections that read one input become one call
        each); why not, or None when packed."""
        try:
            packed = with_packed_linears(self.head)
            attn, mlp = self.head.midlayer.self_attn, self.head.midlayer.mlp
            qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
            packed.midlayer.self_attn.fused_qkv = PackedLinear.pack_fused(qkv)
            packed.midlayer.mlp.fused_gate_up = PackedLinear.pack_fused([mlp.gate_proj, mlp.up_proj])
        except NotPacked as err:
            return str(err)
        self.head = packed
        return None

    def script(self) -> str | None:
        """Step through the scripted halves (infer/cpu/scripted.py); why not, or None when they run."""
        self.script_args, why = self._script_args()
        return why

    def fuse(self) -> str | None:
        """Step through the C++ halves (infer/cpu/fused.py); why not, or None when they run."""
        self.fused, why = self._fused()
        return why

    @torch.no_grad()
    def _script_args(self) -> tuple[tuple | None, str | None]:
        """(what the scripted halves of the head's layer take, None) when every linear is packed and a
        probe step gives the modules' bits; else (None, why not)."""
        layer, head = self.head.midlayer, self.head
        if head.config.norm_before_residual or head.config.norm_output:
            # the scripted halves are EAGLE-3's residual and pre-norm state
            return None, "norm_before_residual / norm_output: the scripted halves have neither"
        parts = (layer.self_attn.fused_qkv, layer.self_attn.o_proj, layer.mlp.fused_gate_up,
                 layer.mlp.down_proj, head.lm_head)
        norms = (layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm, head.norm)
        if not all(isinstance(p, PackedLinear) and p.bias is None for p in parts):
            return None, "a linear is unpacked or has a bias"
        if len({n.eps for n in norms}) != 1:
            return None, "the head's norms differ in eps"
        attn = layer.self_attn
        args = ((layer.input_layernorm.weight, layer.hidden_norm.weight, float(norms[0].eps), parts[0].packed,
                 attn.heads, attn.kv_heads, attn.head_dim),
                (parts[1].packed, layer.post_attention_layernorm.weight, float(norms[0].eps), parts[2].packed,
                 parts[3].packed, head.norm.weight, parts[4].packed))
        gen = torch.Generator().manual_seed(0)
        h = torch.randn(3, self.embed.shape[1], generator=gen).to(self.embed)
        tokens, pos = torch.tensor([1, 2, 3]), torch.arange(3)
        mask = torch.ones(3, 3, dtype=torch.bool).tril()
        self.script_args = None
        want = self._step(h, tokens, pos, 0, mask)
        self.script_args = args
        got = self._step(h, tokens, pos, 0, mask)
        self.script_args = None
        if all(torch.equal(a, b) for a, b in zip(got, want)):
            return args, None
        return None, "the scripted step's probe differs from the modules' step"

    @torch.no_grad()
    def _fused(self):
        """(the C++ halves (infer/cpu/fused.py), None) when the head's layer is scripted, the extension is
        built here and probe steps through them (4 elements after 3 cached ones, then 1 with last_only)
        give the scripted steps' outputs and cache bit for bit; else (None, why not)."""
        if self.script_args is None:
            return None, "the layer is not scripted"
        halves, why = fused_extension()
        if halves is None:
            return None, why
        gen = torch.Generator().manual_seed(1)
        h = torch.randn(4, self.embed.shape[1], generator=gen).to(self.embed)
        cached = torch.randn(1, self.cache.k.shape[1], 3, self.cache.k.shape[3], generator=gen).to(self.embed)
        tokens, pos = torch.tensor([4, 5, 6, 7]), torch.arange(3, 7)
        mask = torch.ones(4, 7, dtype=torch.bool)
        mask[:, 3:] = torch.ones(4, 4, dtype=torch.bool).tril()
        runs, why = [], None
        for fused in (None, halves):
            self.fused = fused
            self.cache.write(0, cached, cached)
            try:
                run = [*self._step(h, tokens, pos, 3, mask),
                       *self._step(h[:1], tokens[:1], pos[:1], 3, mask[:1, :4], last_only=True)]
            except RuntimeError as err:  # a layout the C++ halves refuse
                why = f"the fused layer refuses this head: {str(err).splitlines()[0][:120]}"
                break
            runs.append(run + [self.cache.k[:, :, :7].clone(), self.cache.v[:, :, :7].clone()])
        self.fused, self.cache.committed = None, 0
        if why is None and not all(torch.equal(a, b) for a, b in zip(*runs)):
            why = "the fused layer's probe differs from the TorchScript halves on this CPU"
        return (None, why) if why is not None else (halves, None)

    @torch.no_grad()
    def ingest(self, aux: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor):
        """Commit elements for target positions `positions` (features aux [n, 3Ht], next tokens [n]).
        Returns the last element's state (the head's `finish`) and logits (they propose the next token's
        children)."""
        n, c = len(next_tokens), self.cache.committed
        h = self.head.features(aux.to(self.embed.dtype))
        mask = torch.ones(n, c + n, dtype=torch.bool, device=h.device)
        mask[:, c:] = torch.ones(n, n, dtype=torch.bool, device=h.device).tril()
        x, logits = self._step(h, next_tokens, positions, c, mask, last_only=True)  # a prompt: no [n, Vd]
        self.cache.committed = c + n
        return x[-1], logits[-1]

    @torch.no_grad()
    def build_tree(self, root_token: int, root_hidden: torch.Tensor, root_logits: torch.Tensor, last_pos: int,
                   top_k: int, depth: int, total_tokens: int, plan: RoundPlan | None = None) -> Tree:
        """EAGLE-2 dynamic tree (infer/tree.py is the reference): top_k children of the root from the last
        ingest output, then depth - 1 levels expanding the top_k best frontier nodes in one forward each,
        then rerank to total_tokens. Every frontier node is a draft element; element e sits at cache slot
        committed + e and sees the committed prefix, its ancestors' elements and itself.
        plan (infer/round_cost.py): depth and total_tokens become caps; levels stop once the frontier's best
        node is below plan.grow_threshold, and the rerank keeps the cost-optimal count."""
        dev, d2t, c = root_hidden.device, self.head.d2t, self.cache.committed
        table = CandidateTable.empty(CandidateTable.capacity(top_k, depth), dev)
        n_elem = (depth - 1) * top_k
        # candidate -> element; each element's ancestors (the last row: none)
        elem_of = torch.full((table.tokens.numel(),), -1, dtype=torch.long, device=dev)
        anc = torch.zeros(n_elem + 1, n_elem, dtype=torch.bool, device=dev)
        hid = root_hidden.new_empty((n_elem + 1, root_hidden.shape[-1]))     # element outputs; last row: root
        hid[n_elem] = root_hidden

        def children(logits: torch.Tensor):
            lp, idx = torch.log_softmax(logits.float(), dim=-1).topk(top_k, dim=-1)
            return idx + d2t[idx], lp

        tok, lp = children(root_logits[None])
        self.level_logits = [root_logits[None]]
        frontier = table.best(table.add(torch.tensor([-1], device=dev), tok, lp), top_k)
        e, levels = 0, 1
        log_threshold = plan.log_threshold() if plan is not None else -math.inf
        for _ in range(depth - 1):
            if plan is not None and float(table.scores[frontier].max()) < log_threshold:
                break
            levels += 1
            m = frontier.numel()
            par = table.parents[frontier]
            pe = torch.where(par < 0, n_elem, elem_of[par.clamp(min=0)])  # parent element (n_elem = root)
            rows = anc[pe]  # the parent's ancestors, plus the parent itself unless it is the root
            has = pe < n_elem
            rows[has.nonzero().flatten(), pe[has]] = True
            anc[e:e + m] = rows
            mask = torch.ones(m, c + e + m, dtype=torch.bool, device=dev)
            mask[:, c:c + e] = rows[:, :e]
            mask[:, c + e:] = torch.eye(m, dtype=torch.bool, device=dev)
            x, logits = self._step(hid[pe], table.tokens[frontier], last_pos + table.depths[frontier], c + e,
                                   mask)
            elem_of[frontier] = torch.arange(e, e + m, device=dev)
            hid[e:e + m] = x
            e += m
            self.level_logits.append(logits)
            tok, lp = children(logits)
            frontier = table.best(table.add(frontier, tok, lp), top_k)
        if plan is not None:
            total_tokens, self.expected = sized_width(plan, table.scores[:table.n], levels, total_tokens)
        self.levels, self.table = levels, table
        return finalize_tensor(root_token, table, rerank_tensor(table, total_tokens))
