"""What a training step executes, in FLOPs, by what each part scales with.

One owner for the cost model: the batch planner weighs micro-batches with it (so two ranks get similar work
at each all-reduce, docs/ARCHITECTURE.md §7) and tools/bench/train.py divides achieved FLOP/s by the
machine's peak with it. Multiply-adds count 2; the head's parts count 3x (forward + backward); the frozen
target lm_head counts forward only.
"""
from __future__ import annotations

from dataclasses import dataclass

from trainer.head import HeadConfig


@dataclass(frozen=True)
class StepFlops:
    per_token: float  # fc (3 Ht -> H) once + every TTT step's projections and MLP, on every padded position
    per_token_key: float  # TTT attention (QK^T and PV, every step) per position and key it attends
    per_counted: float  # one TTT step's draft lm_head on one position that step counts
    per_target_row: float  # the target's full-vocab lm_head on one position some step reads
    ttt_length: int

    def batch(self, rows: int, longest: int, loss_tokens: int) -> float:
        """Estimated FLOPs of a padded micro-batch. Causal attention sees ~longest / 2 keys; the loss tokens
        stand for each step's counted positions and for the target rows read (both are the loss mask,
        shifted by a few positions)."""
        body = rows * longest * (self.per_token + self.per_token_key * longest / 2)
        return body + loss_tokens * (self.ttt_length * self.per_counted + self.per_target_row)

    def per_useful_token(self, seq_len: float, counted_share: float, target_share: float) -> float:
        """FLOPs per real (unpadded) token of rows `seq_len` long, where `counted_share` of (token, step)
        pairs are counted and `target_share` of tokens are read from the target (bench_train's shares)."""
        return (self.per_token + self.per_token_key * seq_len / 2
                + self.ttt_length * self.per_counted * counted_share + self.per_target_row * target_share)


def step_flops(c: HeadConfig, ttt_length: int) -> StepFlops:
    """The EAGLE-3 layer takes [embedding; fc(aux)] (2H wide) into q/k/v; o and the SwiGLU MLP are H wide.
    A DFlash head (ttt_length: its block's slots) costs fc and each layer's context k/v on every position,
    and its layers plus the lm_head on every slot; counted as if each loss token anchored a block (anchors
    cap that), which is what weighing batches against each other needs."""
    h, hd, nq, nkv = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    if c.kind == "dflash":
        layer = h * (nq + 2 * nkv) * hd + nq * hd * h + 3 * h * c.intermediate_size
        return StepFlops(per_token=6 * (3 * c.target_hidden_size * h + c.num_layers * 2 * h * nkv * hd),
                         per_token_key=0.0, per_counted=6 * (c.num_layers * layer + h * c.draft_vocab_size),
                         per_target_row=2 * h * c.vocab_size, ttt_length=ttt_length)
    layer = 2 * h * (nq + 2 * nkv) * hd + nq * hd * h + 3 * h * c.intermediate_size
    return StepFlops(per_token=6 * (3 * c.target_hidden_size * h + ttt_length * layer),
                     per_token_key=6 * ttt_length * 2 * nq * hd,
                     per_counted=6 * h * c.draft_vocab_size,
                     per_target_row=2 * h * c.vocab_size, ttt_length=ttt_length)
