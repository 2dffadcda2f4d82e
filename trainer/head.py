"""The EAGLE-3 draft head (ARCHITECTURE.md §5): one decoder layer over [embedding ; fused target features].

Parameter names are exactly the SGLang checkpoint's (fc, midlayer.*, norm, lm_head, d2t, t2d), so a
state_dict is an export. The target's embedding is not part of the head: callers pass embeddings in.
This is the model only: decoding (infer/draft.py) and training (trainer/ttt.py's TTTObjective) own the
attention pattern around `qkv` / `finish`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from pipeline.target import text_config

# RoPE types the exported head can declare in a Llama-style config (both engines implement these).
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


@dataclass
class HeadConfig:
    """The head's shape (ARCHITECTURE.md §5): one Llama layer over [embedding ; fused target features]."""
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int                 # the target's
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    # EAGLE 3.1 options (ARCHITECTURE.md §5, "EAGLE 3.1 options"), each read by vLLM under the same name:
    norm_before_fc: bool = False        # one RMSNorm over the concatenated aux states (`input_norm`)
    fc_norm: bool = False               # an RMSNorm per aux state before the fc (`fc_norm.{i}`)
    norm_before_residual: bool = False  # the residual is hidden_norm(h), not h
    norm_output: bool = False           # the next step is fed the final-normed state
    # The draft kind: "eagle3" (this module's Eagle3Head) or "dflash" (trainer/dflash.py's block drafter:
    # `num_layers` Qwen3-style layers drafting `block_size - 1` tokens per forward; ARCHITECTURE.md §14).
    kind: str = "eagle3"
    num_layers: int = 1
    block_size: int = 0                 # dflash: anchor + masks per block
    mask_token_id: int | None = None    # dflash: the target vocabulary id whose embedding fills the masks
    block_causal: bool = False          # dflash: slot k sees block slots <= k only (vLLM's dflash_config.causal)

    def __post_init__(self):
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("model.norm_before_fc and model.fc_norm: one or the other (both norm the aux states)")
        if self.kind not in DRAFT_KINDS:
            raise ValueError(f"model.kind: {self.kind!r} is not one of {', '.join(DRAFT_KINDS)}")
        if self.kind == "dflash":
            if any(self.options.values()):
                raise ValueError("model.kind: dflash reads none of the EAGLE 3.1 options (norm_before_fc, fc_norm, "
                                 "norm_before_residual, norm_output)")
            if self.num_layers < 1:
                raise ValueError(f"model.num_layers: a DFlash head needs at least one layer, not {self.num_layers}")
            if self.block_size < 2:
                raise ValueError(f"model.block_size: a DFlash block is the anchor plus at least one mask, not {self.block_size}")
            if self.mask_token_id is None or not 0 <= self.mask_token_id < self.vocab_size:
                raise ValueError(f"model.mask_token_id: {self.mask_token_id} is not a target vocabulary id "
                                 f"(0..{self.vocab_size - 1})")
        elif self.block_causal:
            raise ValueError("model.block_causal: an EAGLE-3 head drafts no block")
        elif self.num_layers != 1:
            raise ValueError(f"model.num_layers: an EAGLE-3 head has one layer, not {self.num_layers}")

    @property
    def options(self) -> dict[str, bool]:
        return {k: getattr(self, k) for k in HEAD_OPTIONS}


HEAD_OPTIONS = ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")
DRAFT_KINDS = ("eagle3", "dflash")


def head_rope(tcfg) -> dict:
    """The target's RoPE as a Llama rope_parameters dict (theta + scaling of a type engines load).
    Per-layer-type dicts (Gemma-3) take the full-attention entry; targets without RoPE (GPT-2) get
    theta 10000; partial-rotary and other model-specific fields are dropped (the head is a Llama layer)."""
    rope = getattr(tcfg, "rope_parameters", None) or {}
    if "full_attention" in rope and isinstance(rope["full_attention"], dict):
        rope = rope["full_attention"]
    theta = rope.get("rope_theta", getattr(tcfg, "rope_theta", None) or 10000.0)
    kind = rope.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        kind, rope = "default", {}
    out = {k: v for k, v in rope.items() if k != "partial_rotary_factor"} if kind != "default" else {}
    return out | {"rope_type": kind, "rope_theta": float(theta)}


def head_config_from_target(tcfg, draft_vocab_size: int, intermediate_size: int | None = None,
                            **options) -> HeadConfig:
    """A head shaped like one layer of the target (H, heads, kv heads, rope, eps). Targets whose layers
    are not Llama-shaped (GPT-2, MLA) get head_dim H / heads and an MLP of 4H when they name none."""
    tcfg = text_config(tcfg)
    h = tcfg.hidden_size
    heads = tcfg.num_attention_heads
    head_dim = getattr(tcfg, "head_dim", None) or h // heads
    if getattr(tcfg, "kv_lora_rank", None):  # MLA (DeepSeek-V2/V3): head_dim there is the rope part only
        head_dim = h // heads
    inter = intermediate_size or getattr(tcfg, "intermediate_size", None) or getattr(tcfg, "n_inner", None) or 4 * h
    eps = next((getattr(tcfg, k) for k in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon")
                if getattr(tcfg, k, None)), 1e-6)
    return HeadConfig(hidden_size=h, intermediate_size=inter, num_attention_heads=heads,
                      num_key_value_heads=getattr(tcfg, "num_key_value_heads", None) or heads, head_dim=head_dim,
                      vocab_size=tcfg.vocab_size, draft_vocab_size=draft_vocab_size, target_hidden_size=h,
                      rms_norm_eps=float(eps), max_position_embeddings=tcfg.max_position_embeddings,
                      rope_parameters=head_rope(tcfg), **options)


class Rotary:
    """RoPE tables from an fp32 inv_freq kept outside the module's buffers: `.to(bf16)` and DeepSpeed's
    bf16 casts never round it (a bf16 inv_freq shifts every angle; positions past ~256 go wrong)."""

    def __init__(self, cfg: HeadConfig):
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        llama = LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                            head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
                            rope_parameters=dict(cfg.rope_parameters))
        ref = LlamaRotaryEmbedding(config=llama)
        self.inv_freq = ref.inv_freq.detach().float().cpu().clone()
        self.scaling = float(ref.attention_scaling)
        self._on: dict[torch.device, torch.Tensor] = {}

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self._on.get(positions.device)
        if inv is None:
            inv = self._on[positions.device] = self.inv_freq.to(positions.device)
        freqs = positions.float()[..., None] * inv
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.scaling).to(x.dtype), (emb.sin() * self.scaling).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(2 * h, self.heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, self.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, self.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.heads * hd, h, bias=False)
        # Inference may set one module computing q|k|v side by side (infer/draft.py: one packed call
        # instead of three); training keeps the three linears, whose weights are the checkpoint's.
        self.fused_qkv: nn.Module | None = None

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        b, t, _ = x.shape
        if self.fused_qkv is not None:
            kv = self.kv_heads * self.head_dim
            q, k, v = self.fused_qkv(x).split([self.heads * self.head_dim, kv, kv], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def expand(self, kv: torch.Tensor) -> torch.Tensor:
        """[B, kv, T, d] -> [B, heads, T, d] (GQA)."""
        return kv.repeat_interleave(self.heads // self.kv_heads, dim=1)


class MLP(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.fused_gate_up: nn.Module | None = None  # gate|up in one call (inference; as fused_qkv)

    def forward(self, x):
        if self.fused_gate_up is not None:
            gate, up = self.fused_gate_up(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class MidLayer(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)


class DraftVocab(nn.Module):
    """What every draft kind shares: the draft vocabulary's maps (d2t: draft id -> target id offset, t2d:
    target id in the draft vocabulary) as buffers, and the fp32 RoPE tables. Subclasses call `_draft_vocab`
    after their parameters, so parameter order (and old optimizer checkpoints) stay as they were."""

    def _draft_vocab(self, cfg: HeadConfig) -> None:
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        self.rotary = Rotary(cfg)

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)


class Eagle3Head(DraftVocab):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.config = cfg
        h, h_t = cfg.hidden_size, cfg.target_hidden_size
        self.fc = nn.Linear(3 * h_t, h, bias=False)
        self.input_norm = RMSNorm(3 * h_t, cfg.rms_norm_eps) if cfg.norm_before_fc else None
        self.fc_norm = nn.ModuleList([RMSNorm(h_t, cfg.rms_norm_eps) for _ in range(3)]) if cfg.fc_norm else None
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self._draft_vocab(cfg)

    def features(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [..., 3 Ht] (low, mid, high) -> the first step's h [..., H]."""
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:
            aux = torch.cat([norm(a) for norm, a in zip(self.fc_norm, aux.chunk(3, dim=-1))], dim=-1)
        return self.fc(aux)

    # One decoder step, split in two so callers own the attention (TTT blocks here, tree masks in infer).
    def qkv(self, h: torch.Tensor, emb: torch.Tensor, positions: torch.Tensor):
        layer = self.midlayer
        x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(h)], dim=-1)
        cos, sin = self.rotary(x, positions)
        return layer.self_attn.qkv(x, cos, sin)

    def finish(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual from the input h (un-normed; hidden_norm(h) with norm_before_residual); returns the
        state fed to the next step: pre-norm, or final-normed with norm_output. `logits` takes it."""
        layer, cfg = self.midlayer, self.config
        b, _, t, _ = attn.shape
        res = layer.hidden_norm(h) if cfg.norm_before_residual else h
        x = res + layer.self_attn.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x) if cfg.norm_output else x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Draft logits of a state from `finish` (already normed with norm_output)."""
        return self.lm_head(x if self.config.norm_output else self.norm(x))
