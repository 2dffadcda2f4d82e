"""The DFlash block drafter (ARCHITECTURE.md §14): `num_layers` Qwen3-style layers that draft a whole block
in one forward.

A block is [anchor token, mask, ..., mask] at positions a .. a + B - 1 (B = block_size); slot k > 0
predicts the token at position a + k. Every layer's queries are the block's own states; its keys and values
are the context's (the target's aux states at positions < a, through fc and hidden_norm, projected by that
layer's k/v, k-normed and rotated at their positions) followed by the block's, with no causal order inside
the block. Parameter names are vLLM's `DFlashDraftModel` (layers.{i}.*, fc, hidden_norm, norm, lm_head,
d2t, t2d), so a state_dict is an export. The target's embedding is not part of the head.
This is the model only: training (trainer/dflash_objective.py) and decoding (infer/dflash_draft.py) own
which keys each query sees.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainer.head import MLP, DraftVocab, HeadConfig, RMSNorm


class DFlashAttention(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(h, self.heads * hd, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.heads * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)  # per head, before RoPE (Qwen3)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> k, v [B, kv_heads, T, d]: k normed per head and rotated."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return k * cos + _rotate_half(k) * sin, v

    def q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.heads, self.head_dim)).transpose(1, 2)
        return q * cos + _rotate_half(q) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class DFlashLayer(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """x [B, Q, H] block states; ctx_k/v [B, kv, C, d]; mask [B or 1, 1, Q, C + Q] bool (None: all keys).
        Keys are the context's then the block's own."""
        attn = self.self_attn
        h = self.input_layernorm(x)
        q = attn.q(h, cos, sin)
        k, v = attn.kv(h, cos, sin)
        k, v = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=attn.heads != attn.kv_heads)
        b, _, t, _ = out.shape
        x = x + attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashHead(DraftVocab):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        assert cfg.kind == "dflash", cfg.kind
        self.config = cfg
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(cfg) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self._draft_vocab(cfg)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, T, d] for positions [B, T] (broadcast over heads)."""
        cos, sin = self.rotary(x, positions)
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def context_kv(self, aux: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """aux [B, C, 3Ht] at positions [B, C] -> each layer's context (k, v) [B, kv, C, d]."""
        c = self.hidden_norm(self.fc(aux))
        cos, sin = self.rope(c, positions)
        return [layer.self_attn.kv(c, cos, sin) for layer in self.layers]

    def block(self, emb: torch.Tensor, positions: torch.Tensor, ctx: list[tuple[torch.Tensor, torch.Tensor]],
              mask: torch.Tensor | None) -> torch.Tensor:
        """Block embeddings emb [B, Q, H] at positions [B, Q] over each layer's context (k, v) ->
        the final-normed states [B, Q, H] (`logits` takes them)."""
        cos, sin = self.rope(emb, positions)
        x = emb
        for layer, (k, v) in zip(self.layers, ctx):
            x = layer(x, cos, sin, k, v, mask)
        return self.norm(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(x)


def default_mask_token(embed: torch.Tensor, avoid: set[int]) -> int:
    """The mask slots' token when the config names none: the last vocabulary id whose embedding row is not
    zero (padding rows of a resized vocabulary often are: every mask query would then be the same zero
    vector) and that the tokenizer does not use as eos / bos / pad (an anchor equal to it would read as a mask)."""
    nonzero = embed.float().norm(dim=-1) > 0
    for i in range(embed.shape[0] - 1, -1, -1):
        if nonzero[i] and i not in avoid:
            return i
    raise ValueError("model.mask_token_id: the target's embedding has no nonzero row to use as the mask")

