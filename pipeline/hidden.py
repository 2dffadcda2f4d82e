"""Target capture (ARCHITECTURE.md §4): fused low/mid/high residual states and the final-norm output.

Aux states are the outputs of decoder layers [1, N//2-1, N-4] (HF hidden_states[j+1], the rule lives in
pipeline/target.py); `last_hidden` is what the lm_head consumes. Forward hooks on the decoder layers take
them from any Hugging Face causal LM without a patched class.
The base model is run without the lm_head, so capture costs no more than a bare forward.
"""
from __future__ import annotations

import torch

from pipeline.target import decoder_layers


class AuxTap:
    """Forward hooks on the aux layers of any HF causal LM: after a forward, `states()` is their
    outputs concatenated low|mid|high [B, T, 3H]. Capture uses one per call, decoding keeps one."""

    def __init__(self, model, layer_ids: list[int]):
        layers = decoder_layers(model)  # refuses, naming the class, when there are none
        self.layer_ids = list(layer_ids)
        self._got: dict[int, torch.Tensor] = {}
        self._handles = [layers[j].register_forward_hook(self._hook(j)) for j in self.layer_ids]

    def _hook(self, j: int):
        def fn(_module, _inputs, output):
            self._got[j] = output[0] if isinstance(output, tuple) else output
        return fn

    def states(self) -> torch.Tensor:
        return torch.cat([self._got[j] for j in self.layer_ids], dim=-1)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


@torch.no_grad()
def capture_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                   layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (aux [B, T, 3H] low|mid|high, last [B, T, H]) in the model's dtype."""
    decoder_layers(model)  # refuses, naming the class, when there are none
    base = getattr(model, "base_model", None)
    if base is None or base is model:
        out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                    use_cache=False)
        hs = out.hidden_states
        return torch.cat([hs[j + 1] for j in layer_ids], dim=-1), hs[-1]
    tap = AuxTap(model, layer_ids)
    try:
        out = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        tap.remove()
    return tap.states(), out.last_hidden_state


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A GPU tensor copied to host memory in one transfer through a pinned buffer (pageable copies of
    each row's slice are several times slower); a CPU tensor is returned as is."""
    if t.device.type != "cuda":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return out


@torch.no_grad()
def check_logit_rule(model, layer_ids: list[int], tokens: int = 12) -> float:
    """Refuse a target whose logits are not `target_logits(last_hidden)` (pipeline/target.py): training
    would learn another distribution than the one decoding verifies against. Returns the max abs error."""
    from pipeline.target import LogitRule, target_logits, text_config

    device = next(model.parameters()).device
    ids = (torch.arange(tokens, device=device)[None] * 7 + 3) % text_config(model.config).vocab_size
    _, last = capture_hidden(model, ids, None, layer_ids)
    head = model.get_output_embeddings()
    ours = target_logits(last.float(), head.weight.float(), None if getattr(head, "bias", None) is None
                         else head.bias.float(), LogitRule.of(model.config))
    theirs = model(input_ids=ids, use_cache=False).logits.float()
    err = float((ours - theirs).abs().max())
    if not err <= 1e-3 * max(1.0, float(theirs.abs().max())):
        raise ValueError(f"{type(model).__name__}: its logits differ from lm_head(last_hidden) under the known "
                         f"transforms (bias, soft-capping, logit scale) by {err:.3g}; this target transforms its "
                         f"logits in a way EagleRay does not model, so a head trained on it would learn the wrong "
                         f"distribution")
    return err
