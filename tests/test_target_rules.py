"""The target description's rules and the defects around them: aux ids, refusals, warm start, RoPE
precision in bf16, lossless sampling corner, fp16 overflow, tree-parameter convention."""
from __future__ import annotations

import pytest
import torch
import transformers as T

from infer.generate import SpecSettings
from infer.tree import Candidates, accept_sampling, finalize
from pipeline.codec import StorageOverflow, to_bytes
from pipeline.target import attention_layout, decoder_layers, default_aux_layers, resolve_aux_layers
from trainer.head import Eagle3Head, HeadConfig, Rotary
from trainer.warm_start import remap_lm_head, warm_start_state


def test_aux_layers_rule_and_small_targets():
    assert default_aux_layers(32) == [1, 15, 28] and default_aux_layers(8) == [1, 3, 4]
    assert default_aux_layers(7) == [1, 2, 3]  # the rule itself, still distinct
    for n, want in ((3, [0, 1, 2]), (4, [1, 2, 3]), (5, [1, 2, 3]), (6, [1, 2, 3])):
        assert default_aux_layers(n) == want  # the rule would repeat layers here
        assert resolve_aux_layers(n, None) == want
    with pytest.raises(ValueError, match="fewer than 3 decoder layers"):
        default_aux_layers(2)
    with pytest.raises(ValueError, match=r"capture.layer_ids: \[4, 2, 6\] must be strictly ascending"):
        resolve_aux_layers(8, [4, 2, 6])
    with pytest.raises(ValueError, match=r"\[2, 2, 6\] must be strictly ascending"):
        resolve_aux_layers(8, [2, 2, 6])


def test_unsupported_targets_are_refused_up_front():
    class NoLayers(torch.nn.Module):
        config = T.LlamaConfig(num_hidden_layers=4)

    with pytest.raises(ValueError, match="NoLayers: no ModuleList of its 4 decoder layers"):
        decoder_layers(NoLayers())
    cfg = T.Qwen3NextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=2,
                            num_experts_per_tok=1, moe_intermediate_size=16, linear_num_value_heads=2,
                            linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
    with torch.device("meta"):
        model = T.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match=r"Qwen3NextForCausalLM: layer types \['linear_attention'\]"):
        attention_layout(model)
    with torch.device("meta"):
        gpt2 = T.AutoModelForCausalLM.from_config(T.GPT2Config(n_layer=4, n_embd=32, n_head=2))
    assert decoder_layers(gpt2) is gpt2.transformer.h


def test_warm_start_remaps_lm_head_rows_by_target_token():
    """Old draft vocab = target tokens {2, 5, 7}; new = {5, 6, 7, 9}: rows for 5 and 7 move to their new
    draft ids, 6 and 9 start from the target's lm_head rows (rescaled). Without the remap new id 0 (token 5)
    would score with the row trained for token 2."""
    h, vocab = 4, 12
    target_lm = torch.arange(vocab * h, dtype=torch.float32).view(vocab, h) * -1.0
    old_tokens, new_tokens = torch.tensor([2, 5, 7]), torch.tensor([5, 6, 7, 9])
    old_d2t, new_d2t = old_tokens - torch.arange(3), new_tokens - torch.arange(4)
    old_w = torch.stack([torch.full((h,), float(t)) for t in old_tokens.tolist()])  # row = its token id
    rows, kept = remap_lm_head(old_w, old_d2t, new_d2t, target_lm)
    assert kept == 2
    torch.testing.assert_close(rows[0], torch.full((h,), 5.0))
    torch.testing.assert_close(rows[2], torch.full((h,), 7.0))
    norm = old_w.norm(dim=1).mean()  # new rows: the target's direction at the old rows' mean norm
    torch.testing.assert_close(rows[1], target_lm[6] * norm / target_lm[6].norm())
    torch.testing.assert_close(rows[3], target_lm[9] * norm / target_lm[9].norm())


def test_warm_start_refuses_a_head_of_another_shape():
    cfg = HeadConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                     vocab_size=12, draft_vocab_size=4, target_hidden_size=8)
    other = HeadConfig(**{**cfg.__dict__, "hidden_size": 16, "target_hidden_size": 16, "head_dim": 8})
    state = {k: v for k, v in Eagle3Head(other).state_dict().items() if k != "rotary"}
    with pytest.raises(ValueError, match="model.init_from: fc.weight has shape"):
        warm_start_state(state, cfg, torch.zeros(4, dtype=torch.long), torch.zeros(12, 8))
    good = Eagle3Head(cfg).state_dict()
    out = warm_start_state(good, cfg, torch.tensor([1, 1, 1, 1]), torch.randn(12, 8))
    assert out["lm_head.weight"].shape == (4, 8) and out["d2t"].tolist() == [1, 1, 1, 1] and "t2d" not in out


def test_head_rope_stays_fp32_in_bf16():
    cfg = HeadConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, vocab_size=32, draft_vocab_size=32, target_hidden_size=64,
                     rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    head = Eagle3Head(cfg).to(torch.bfloat16)
    assert head.rotary.inv_freq.dtype == torch.float32
    pos = torch.tensor([[3000]])
    x = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    cos, _ = head.rotary(x, pos)
    ref = Rotary(cfg)
    want = torch.cos(pos.double()[..., None] * ref.inv_freq.double())
    assert (cos[0, 0, :8].double() - want[0, 0]).abs().max() < 1e-2  # bf16 rounding of cos only
    bad = torch.cos(pos.double()[..., None] * ref.inv_freq.to(torch.bfloat16).double())
    assert (bad[0, 0] - want[0, 0]).abs().max() > 0.1  # what a bf16 inv_freq would have done


def test_sampling_never_reemits_a_rejected_child():
    """All of the target's mass on the root's two children, the second holding the rest exactly: the
    second is accepted whenever the first is rejected; the bonus is never a rejected child."""
    vocab = 8
    tree = finalize(0, Candidates([3, 5], [-1, -1], [-0.1, -0.2], [1, 1]), [0, 1])
    probs = torch.zeros(tree.size, vocab)
    probs[0, 3], probs[0, 5] = 0.6, 0.4
    probs[1:, 1] = 1.0
    firsts = set()
    for seed in range(300):
        accepted, bonus = accept_sampling(tree, probs, torch.Generator().manual_seed(seed))
        assert len(accepted) == 2 and bonus == 1, (seed, accepted, bonus)
        firsts.add(accepted[1])
    assert firsts == {1, 2}
    # An unnormalised row (mass lost upstream): rejecting 3 leaves nothing, so 3 is accepted outright.
    probs[0] = 0.0
    probs[0, 3] = 0.5
    for seed in range(50):
        accepted, bonus = accept_sampling(tree, probs, torch.Generator().manual_seed(seed))
        assert accepted == [0, 1] and bonus == 1


def test_fp16_overflow_is_refused_not_stored_as_inf():
    ok = torch.tensor([[1.0, -2.0], [65000.0, 3.0]])
    assert len(to_bytes(ok, "fp16")) == 8
    with pytest.raises(StorageOverflow, match=r"does not fit fp16 \(max \|x\| = 7e\+04\).*capture.dtype: bf16"):
        to_bytes(torch.tensor([[1.0, 70000.0]]), "fp16")
    assert len(to_bytes(torch.tensor([[1.0, 70000.0]]), "bf16")) == 4


def test_official_eagle_parameters_translate():
    s = SpecSettings.from_eagle(10, 7, 60, max_new_tokens=32)
    assert (s.top_k, s.depth, s.total_tokens, s.max_new_tokens) == (10, 8, 61, 32)
