"""The EAGLE-3 draft head (DESIGN §4): one decoder layer over [embedding ; fused target features].

Parameter names are exactly the SGLang checkpoint's (fc, midlayer.*, norm, lm_head, d2t, t2d), so a
state_dict is an export. The target's embedding is not part of the head: callers pass embeddings in.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from trainer.ttt import (shift_left, step_correct, step_loss, ttt_attention, step_weights)


def head_config_from_target(tcfg, draft_vocab_size: int, intermediate_size: int | None = None) -> LlamaConfig:
    """A head shaped like one layer of the target (H, heads, kv heads, head_dim, rope, eps)."""
    tcfg = getattr(tcfg, "text_config", None) or tcfg
    heads = tcfg.num_attention_heads
    rope = getattr(tcfg, "rope_parameters", None) or {"rope_type": "default",
                                                       "rope_theta": getattr(tcfg, "rope_theta", 10000.0)}
    cfg = LlamaConfig(
        hidden_size=tcfg.hidden_size, intermediate_size=intermediate_size or tcfg.intermediate_size,
        num_hidden_layers=1, num_attention_heads=heads,
        num_key_value_heads=getattr(tcfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(tcfg, "head_dim", None) or tcfg.hidden_size // heads,
        vocab_size=tcfg.vocab_size, rms_norm_eps=tcfg.rms_norm_eps,
        max_position_embeddings=tcfg.max_position_embeddings, rope_parameters=dict(rope),
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    cfg.draft_vocab_size = draft_vocab_size
    cfg.target_hidden_size = tcfg.hidden_size
    return cfg


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(2 * h, self.heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, self.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, self.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.heads * hd, h, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def expand(self, kv: torch.Tensor) -> torch.Tensor:
        """[B, kv, T, d] -> [B, heads, T, d] (GQA)."""
        return kv.repeat_interleave(self.heads // self.kv_heads, dim=1)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)


class Eagle3Head(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        h, h_t = cfg.hidden_size, getattr(cfg, "target_hidden_size", None) or cfg.hidden_size
        self.fc = nn.Linear(3 * h_t, h, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        self.rotary = LlamaRotaryEmbedding(config=cfg)

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    # One decoder step, split in two so callers own the attention (TTT blocks here, tree masks in infer).
    def qkv(self, h: torch.Tensor, emb: torch.Tensor, positions: torch.Tensor):
        layer = self.midlayer
        x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(h)], dim=-1)
        cos, sin = self.rotary(x, positions)
        return layer.self_attn.qkv(x, cos, sin)

    def finish(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual from the un-normed input h; returns the pre-norm output fed to the next step."""
        layer = self.midlayer
        b, _, t, _ = attn.shape
        x = h + layer.self_attn.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))

    def forward(self, aux: torch.Tensor, emb: torch.Tensor, target_p: torch.Tensor, target_argmax: torch.Tensor,
                loss_mask: torch.Tensor, ttt_length: int, decay: float) -> dict:
        """TTT unroll over a padded batch. aux [B,T,3Ht], emb [B,T,H] (embeddings of input_ids),
        target_p [B,T,Vd] and target_argmax [B,T] at each position, loss_mask [B,T]."""
        b, t, _ = emb.shape
        h = self.fc(aux)
        causal = torch.full((t, t), float("-inf"), device=emb.device, dtype=h.dtype).triu(1)
        attn_mod = self.midlayer.self_attn
        keys, values = [], []
        total = h.new_zeros((), dtype=torch.float32)
        losses, correct, counted = [], [], []
        for s, w in enumerate(step_weights(ttt_length, decay)):
            pos = (torch.arange(t, device=emb.device) + s).unsqueeze(0).expand(b, t)
            q, k, v = self.qkv(h, shift_left(emb, 1 + s), pos)
            keys.append(attn_mod.expand(k))
            values.append(attn_mod.expand(v))
            x = self.finish(h, ttt_attention(q, keys, values, causal))
            logits = self.logits(x)
            tgt_am = shift_left(target_argmax, 1 + s)
            lm = shift_left(loss_mask, 2 + s).to(logits.dtype)
            pm = lm * self.t2d[tgt_am].to(logits.dtype)
            loss = step_loss(logits, shift_left(target_p, 1 + s), pm)
            total = total + w * loss
            losses.append(loss.detach())
            with torch.no_grad():
                ok = step_correct(logits, self.d2t, tgt_am) & lm.bool()
                correct.append(ok.sum())
                counted.append(lm.sum())
            h = x
        return {"loss": total, "step_loss": torch.stack(losses), "step_correct": torch.stack(correct).float(),
                "step_count": torch.stack(counted).float()}
