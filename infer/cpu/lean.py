"""A lean forward for Llama-shaped targets: the HF model's own modules, a KV cache we own, no per-call
machinery (the "lean" rungs of the fast path, infer/cpu/__init__.py).

Most of a small target's decode step on CPU is not its matmuls but what wraps them (mask builders, cache
objects, output records, hooks). For the families whose decoder layer is exactly
`x + o(attn(rope(q), rope(k), v))` then `x + mlp(norm(x))` (Llama, Mistral and Qwen2 without a sliding
window, Qwen3 with its q/k norms), this module runs the same submodules in that order on a preallocated
cache: K/V are written at slots, accepted paths are compacted by one `index_copy_` over every layer, and
the aux states come from the loop instead of hooks. Every other family keeps the HF forward.

`infer.cpu.choose_target` builds it, packs, scripts and fuses it as far as each probe allows here, then
runs one short prompt through both forwards and refuses it when the logits differ, so an unforeseen variant
of a supported family falls back instead of decoding another model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from infer.cpu.fused import extension as fused_extension
from infer.cpu.exact_attention import PathGroups, PrefixCopies, path_attention
from infer.cpu.packed import NotPacked, PackedLinear, packing_unsupported, rows_depend_on_count
from infer.cpu.scripted import attention_inputs, output_and_mlp
from pipeline.target import FULL, attention_layout, text_config

LEAN_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
_ATTN_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")


class StaticKV:
    """K and V of every layer in one tensor [L, 2, kv_heads, capacity, head_dim], one per sequence; slots
    [0, length) are the committed sequence. Capacity doubles when a write would overflow."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, like: torch.Tensor, capacity: int = 512):
        self.kv = like.new_empty((layers, 2, kv_heads, capacity, head_dim))  # slots are written before read
        self.length = 0
        self.copies: PrefixCopies | None = None  # made by the first exact verify (exact_attention.py)

    def reserve(self, end: int) -> None:
        cap = self.kv.shape[3]
        if end > cap:
            pad = self.kv.new_empty((*self.kv.shape[:3], max(end, 2 * cap) - cap, self.kv.shape[4]))
            self.kv = torch.cat([self.kv, pad], dim=3)
        if self.copies is not None:
            self.copies.fit(self.kv.shape[3])

    def compact(self, src: torch.Tensor, dst: torch.Tensor, new_len: int) -> None:
        """Move slots src -> dst in every layer at once, then keep [0, new_len)."""
        s, d = src.to(self.kv.device), dst.to(self.kv.device)
        self.kv.index_copy_(3, d, self.kv.index_select(3, s))
        self.length = new_len
        if self.copies is not None:
            self.copies.cut(min(new_len, int(d.min()) if d.numel() else new_len))


def lean_unsupported(model) -> str | None:
    """Why `model` cannot take the lean forward, or None when it can (family, layout, module names)."""
    cfg = text_config(model.config)
    if cfg.model_type not in LEAN_FAMILIES:
        return f"model_type {cfg.model_type!r} is not one of {LEAN_FAMILIES}"
    if attention_layout(model).types != (FULL,) * cfg.num_hidden_layers:
        return "sliding-window or chunked layers"
    inner = getattr(model, "model", None)
    if not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return f"{type(model).__name__}.model lacks embed_tokens / layers / norm / rotary_emb"
    for layer in inner.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None or not all(hasattr(attn, p) for p in _ATTN_PARTS) or not hasattr(layer, "mlp"):
            return f"{type(layer).__name__} is not q/k/v/o_proj + mlp"
    return None


class LeanTarget:
    def __init__(self, model, aux_layer_ids: list[int], exact_verify: bool = True):
        cfg = text_config(model.config)
        self.model = model
        self.inner = model.model
        self.aux_layer_ids = list(aux_layer_ids)
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.weight = next(model.parameters())
        self.scaling = self.inner.layers[0].self_attn.scaling
        # What `pack`, `script` and `fuse` set, each where its probe allows (infer.cpu.choose_target):
        # oneDNN-packed linears; the packed layers as TorchScript halves (HF's ops, HF's bits, no per-op
        # Python; q and k out of one q|k|v call, rotated together); those halves as one C++ call each.
        # None: the modules' own linears / the modules' layer (`_layer`) / the TorchScript halves.
        self.packed = self.script_args = self.fused = None
        # Below fp32, a masked verify row does not round like the 1-token step that HF generate takes
        # (infer/cpu/exact_attention.py); path_attention gives that step's bits. fp32 and fp64 take the
        # one masked call: their rows differ from the steps' by ~1e-7 / ~1e-16 relative.
        # exact_verify=False: the one masked call in any dtype (infer/checks/lossless.py --fused-verify).
        self.exact_attention = exact_verify and torch.finfo(self.weight.dtype).bits < 32
        # exact verify: [qkv, o, gate_up, down, lm_head] called a row at a time, where this CPU's GEMM rounds
        # a row of a multi-row call differently from its 1-row call (`plan_verify`)
        self.row_wise = [False] * 5

    def pack(self) -> str | None:
        """Pack every linear for oneDNN; why not, or None when packed."""
        self.packed, why = pack_layers(self.model)
        return why

    def script(self) -> str | None:
        """Run the packed layers as the TorchScript halves; why not, or None when they do."""
        self.script_args, why = self._script_args()
        return why

    def fuse(self) -> str | None:
        """Run the scripted halves as the C++ ones; why not, or None when they do."""
        self.fused, why = self._fused()
        return why

    def plan_verify(self) -> list[str]:
        """Decide, once the linears are settled, which of them an exact verify calls a row at a time;
        returns their names."""
        if self.exact_attention:
            self.row_wise = self._row_wise()
        return [n for n, r in zip(("qkv", "o", "gate_up", "down", "lm_head"), self.row_wise) if r]

    @torch.no_grad()
    def probe(self, n: int = 12) -> str | None:
        ids = torch.arange(3, 3 + n, device=self.weight.device) % self.model.config.vocab_size
        want = self.model(input_ids=ids[None], use_cache=False).logits[0].float()
        got, _ = self.forward(ids, torch.arange(n, device=ids.device), self.new_cache())
        err = (got - want).abs().max().item()
        if err <= 1e-4 * max(1.0, want.abs().max().item()):
            return None
        return f"probe logits differ by {err:.3g}"

    def new_cache(self) -> StaticKV:
        return StaticKV(len(self.inner.layers), self.kv_heads, self.head_dim, self.weight)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticKV, mask=None,
                last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens, positions [n] written at cache slots [length, length + n) -> (logits [n, V] fp32 or
        [1, V] when last_only, aux [n, 3H]). mask: None (causal), an additive / bool [1, 1, n, length + n],
        or {full_attention: that mask} as `TargetRunner.verify_masks` gives it."""
        n, start = tokens.shape[0], cache.length
        end = start + n
        if isinstance(mask, dict):  # models that take {layer type: mask}; lean targets have one type
            mask = mask[FULL]
        cache.reserve(end)
        if mask is not None and self.exact_attention:  # a verify: rows as their 1-token steps round
            key_positions = torch.cat([torch.arange(start, device=positions.device), positions])
            mask = PathGroups(mask, key_positions)
            if cache.copies is None:
                cache.copies = PrefixCopies(cache.kv)
        causal = mask is None and n > 1
        if causal and start > 0:  # new rows see the whole prefix and each other causally
            mask = torch.ones(n, end, dtype=torch.bool, device=tokens.device).tril(start)[None, None]
            causal = False
        rows = self.row_wise if isinstance(mask, PathGroups) else [False] * 5
        x = self.inner.embed_tokens(tokens)[None]
        cos, sin = self.inner.rotary_emb(x, positions[None])  # [1, n, D]
        aux = []
        scripted = self.script_args is not None
        if scripted:
            cos, sin = cos[:, :, None], sin[:, :, None]  # for q and k rows laid out [1, n, heads, D]
        exact = isinstance(mask, PathGroups)
        for i, layer in enumerate(self.inner.layers):
            copies = (cache.copies.buf[i], cache.copies.synced) if exact else None
            if scripted:
                x = self._layer_scripted(self.script_args[i], x, cos, sin, cache.kv[i], start, end, mask,
                                         causal, rows, copies)
            else:
                x = self._layer(layer, x, cos, sin, cache.kv[i], start, end, mask, causal,
                                self.packed["layers"][i] if self.packed else None, rows, copies)
            if i in self.aux_layer_ids:
                aux.append(x[0])
        cache.length = end
        if exact:
            cache.copies.synced = start
        h = self.inner.norm(x[:, -1:] if last_only else x)
        lm_head = self.packed["lm_head"] if self.packed else self.model.lm_head
        return by_rows(lm_head, h, rows[4])[0].float(), torch.cat(aux, dim=-1)

    def _layer(self, layer, x, cos, sin, kv, start: int, end: int, mask, causal: bool,
               packed: dict | None, rows: list[bool], copies=None) -> torch.Tensor:
        """One decoder layer in HF's order through the model's modules (fp32, Qwen3's q/k norms, or a
        layer the script does not reproduce); writes this layer's K/V (kv [2, kv_heads, capacity, D]).
        packed: this layer's oneDNN-packed q|k|v, o, gate|up and down (or None: the modules' own).
        rows: `row_wise` for a verify (without packing, the MLP runs a row at a time as one unit).
        copies: an exact verify's (this layer's PrefixCopies buffer, its synced slots), else None."""
        a, n, D = layer.self_attn, x.shape[1], self.head_dim
        h = layer.input_layernorm(x)
        if packed:
            q, k, v = by_rows(packed["qkv"], h, rows[0]).split(packed["qkv_sizes"], dim=-1)
        else:
            q, k, v = by_rows(unpacked_qkv(a), h, rows[0]).split(
                [a.q_proj.out_features, a.k_proj.out_features, a.v_proj.out_features], dim=-1)
        q, k = q.view(1, n, self.heads, D), k.view(1, n, self.kv_heads, D)
        if hasattr(a, "q_norm"):  # Qwen3: RMSNorm over each head before the rotation
            q, k = a.q_norm(q), a.k_norm(k)
        q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        v = v.view(1, n, self.kv_heads, D).transpose(1, 2)
        attn = self._attend(q, k, v, kv, start, end, mask, causal, copies)
        x = x + by_rows(packed["o"] if packed else a.o_proj, attn, rows[1])
        h = layer.post_attention_layernorm(x)
        if not packed:
            return x + by_rows(layer.mlp, h, rows[2] or rows[3])
        gate, up = by_rows(packed["gate_up"], h, rows[2]).chunk(2, dim=-1)
        return x + by_rows(packed["down"], layer.mlp.act_fn(gate) * up, rows[3])

    def _layer_scripted(self, args: tuple, x, cos, sin, kv, start: int, end: int, mask, causal: bool,
                        rows: list[bool], copies=None):
        """`_layer` for a packed Llama-shaped layer, in its two halves around the attention: the C++ ones
        (`self.fused`) or, where that is None, the TorchScript ones (infer/cpu/scripted.py); args: this
        layer's `script_args` entry."""
        norm1, eps1, qkv, qkv_b, o, o_b, norm2, eps2, gate_up, gate_up_b, down, down_b = args
        halves = self.fused
        if halves is not None:  # writes k and v into the cache itself
            q, k, v = halves.attention_inputs(x, norm1, eps1, qkv, qkv_b, cos, sin, self.heads, self.kv_heads,
                                              self.head_dim, rows[0], kv[0], kv[1], start), None, None
        else:
            q, k, v = attention_inputs(x, norm1, eps1, qkv, qkv_b, cos, sin, self.heads, self.kv_heads,
                                       self.head_dim, rows[:4])
        attn = self._attend(q, k, v, kv, start, end, mask, causal, copies)
        tail = halves.output_and_mlp if halves is not None else output_and_mlp
        return tail(x, attn, o, o_b, norm2, eps2, gate_up, gate_up_b, down, down_b, rows[:4])

    def _row_wise(self) -> list[bool]:
        """[qkv, o, gate_up, down, lm_head]: which of layer 0's linears (as the forward calls them; every
        layer has the same shapes) and the lm_head round a row differently in a multi-row call."""
        layer, H = self.inner.layers[0], self.inner.embed_tokens.weight.shape[1]
        a, mlp, p = layer.self_attn, layer.mlp, self.packed["layers"][0] if self.packed else None
        qkv = p["qkv"] if p else unpacked_qkv(a)
        width = a.o_proj.in_features
        if p:
            mlp_parts = [(p["gate_up"], H), (p["down"], mlp.down_proj.in_features)]
        else:  # the modules' path calls the MLP as one unit
            mlp_parts = [(mlp, H)] * 2
        lm_head = self.packed["lm_head"] if self.packed else self.model.lm_head
        parts = [(qkv, H), (p["o"] if p else a.o_proj, width), *mlp_parts, (lm_head, H)]
        return [rows_depend_on_count(fn, k, self.weight) for fn, k in parts]

    def _attend(self, q, k, v, kv, start: int, end: int, mask, causal: bool, copies=None) -> torch.Tensor:
        """Write k, v [1, kv_heads, n, D] at slots [start, end) (None: written already); attend q
        [1, heads, n, D] -> [1, n, heads * D]. copies: see `_layer`."""
        n, width = q.shape[2], self.heads * self.head_dim
        if k is not None:
            kv[0, :, start:end] = k[0]
            kv[1, :, start:end] = v[0]
        if isinstance(mask, PathGroups):  # exact attention: [n, heads, 1, D]
            buf, synced = copies if copies is not None else (None, 0)
            return path_attention(q, kv[:, :, :end], mask, self.scaling, buf, synced, start).reshape(1, n, width)
        o = F.scaled_dot_product_attention(q, kv[0, None, :, :end], kv[1, None, :, :end], attn_mask=mask,
                                           is_causal=causal, scale=self.scaling, enable_gqa=True)
        return o.transpose(1, 2).reshape(1, n, width)

    @torch.no_grad()
    def _fused(self):
        """(the C++ halves (infer/cpu/fused.py), None) when the layers are scripted, the extension is
        built here and layer 0 through it gives the TorchScript halves' bits on a probe (rows after a
        cached prefix, one row, and linears called a row at a time); else (None, why not)."""
        if self.script_args is None:
            return None, "the layers are not scripted"
        halves, why = fused_extension()
        if halves is None:
            return None, why
        gen = torch.Generator().manual_seed(1)
        H = self.inner.embed_tokens.weight.shape[1]
        for n, start, rows in ((5, 3, [False] * 4), (1, 7, [False] * 4), (4, 2, [True] * 4)):
            x = torch.randn(1, n, H, generator=gen).to(self.weight)
            cos, sin = self.inner.rotary_emb(x, torch.arange(start, start + n, device=x.device)[None])
            cos, sin = cos[:, :, None], sin[:, :, None]
            cached = torch.randn(2, self.kv_heads, start + n, self.head_dim, generator=gen).to(self.weight)
            kv = [cached.clone(), cached.clone()]
            outs = []
            for i, fused in enumerate((halves, None)):
                self.fused = fused  # what _layer_scripted runs
                try:
                    outs.append(self._layer_scripted(self.script_args[0], x, cos, sin, kv[i], start,
                                                     start + n, None, n > 1, rows))
                except RuntimeError as err:  # a layout the C++ halves refuse (say, fp32 norm weights)
                    self.fused = None
                    return None, f"the fused layer refuses this layer: {str(err).splitlines()[0][:120]}"
            if not (torch.equal(outs[0], outs[1]) and torch.equal(kv[0], kv[1])):
                self.fused = None
                return None, "the fused layer's probe differs from the TorchScript halves on this CPU"
        self.fused = None
        return halves, None

    @torch.no_grad()
    def _script_args(self) -> tuple[list[tuple] | None, str | None]:
        """(per layer, what the scripted halves take; None) when the layers are packed, have no q/k norms
        and RMSNorms with `variance_epsilon`, and layer 0 scripted gives `_layer`'s bits on a probe; else
        (None, why not)."""
        if self.packed is None:
            return None, "the linears are not packed"
        if hasattr(self.inner.layers[0].self_attn, "q_norm"):
            return None, "q/k norms (Qwen3): the scripted layer has none"
        args = []
        for layer, p in zip(self.inner.layers, self.packed["layers"]):
            n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
            if not all(hasattr(m, "variance_epsilon") for m in (n1, n2)):
                return None, f"{type(n1).__name__} has no variance_epsilon"
            args.append((n1.weight, float(n1.variance_epsilon), p["qkv"].packed, p["qkv"].bias, p["o"].packed,
                         p["o"].bias, n2.weight, float(n2.variance_epsilon), p["gate_up"].packed,
                         p["gate_up"].bias, p["down"].packed, p["down"].bias))
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(1, 5, self.inner.embed_tokens.weight.shape[1], generator=gen).to(self.weight)
        cos, sin = self.inner.rotary_emb(x, torch.arange(5, device=x.device)[None])
        kv = [self.weight.new_zeros(2, self.kv_heads, 8, self.head_dim) for _ in range(2)]
        batched = [False] * 5
        want = self._layer(self.inner.layers[0], x, cos, sin, kv[0], 0, 5, None, True,
                           self.packed["layers"][0], batched)
        got = self._layer_scripted(args[0], x, cos[:, :, None], sin[:, :, None], kv[1], 0, 5, None, True,
                                   batched)
        if torch.equal(got, want) and torch.equal(kv[0], kv[1]):
            return args, None
        return None, "the scripted layer's probe differs from the modules' layer"


def unpacked_qkv(attn):
    """q|k|v side by side from the attention module's own three projections."""
    return lambda h: torch.cat([attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)], dim=-1)


def by_rows(linear, x: torch.Tensor, per_row: bool) -> torch.Tensor:
    """linear(x) for x [1, n, K]; per_row: one call per row (see LeanTarget.row_wise)."""
    if not per_row or x.shape[1] == 1:
        return linear(x)
    return torch.cat([linear(x[:, i:i + 1]) for i in range(x.shape[1])], dim=1)


def pack_layers(model) -> tuple[dict | None, str | None]:
    """(every linear of a bf16 Llama-shaped model packed for oneDNN (infer/cpu/packed.py), q|k|v and
    gate|up fused; None), or (None, why not): packing unsupported or not exact here, or an MLP that is
    not gate/up/down."""
    layers = model.model.layers
    why = packing_unsupported(model.lm_head.weight)
    if why is not None:
        return None, why
    mlp_parts = ("gate_proj", "up_proj", "down_proj", "act_fn")
    if not all(all(hasattr(layer.mlp, p) for p in mlp_parts) for layer in layers):
        return None, "the MLP is not gate_proj / up_proj / down_proj"
    head = model.lm_head
    try:
        out = {"lm_head": PackedLinear.pack(head.weight, head.bias), "layers": []}
        for layer in layers:
            a, mlp = layer.self_attn, layer.mlp
            qkv = [a.q_proj, a.k_proj, a.v_proj]
            out["layers"].append({
                "qkv": PackedLinear.pack_fused(qkv), "qkv_sizes": [m.out_features for m in qkv],
                "o": PackedLinear.pack(a.o_proj.weight, a.o_proj.bias),
                "gate_up": PackedLinear.pack_fused([mlp.gate_proj, mlp.up_proj]),
                "down": PackedLinear.pack(mlp.down_proj.weight, mlp.down_proj.bias)})
    except NotPacked as err:
        return None, str(err)
    return out, None
