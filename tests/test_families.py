"""Any Hugging Face target, proved on tiny random configs of 14 families (no downloads).

For each family: capture equals `output_hidden_states` at the agreed layers (padded batches too); the
target's logits are what training computes from the captured `last_hidden`; tree and chain greedy
decoding are token-identical to HF greedy `generate` on prompts four times longer than the sliding
window; training steps through the trainer's own target parts bring the TTT loss down; and the TTT
step-s logits at position i equal the decoder's chain logits at depth s after ingesting 0..i.
"""
from __future__ import annotations

import pytest
import torch
import transformers as T

from infer.generate import EagleGenerator, SpecSettings
from pipeline.hidden import capture_hidden, check_logit_rule
from pipeline.target import attention_layout, default_aux_layers
from trainer.head import Eagle3Head, head_config_from_target
from trainer.target_parts import load_target_parts
from trainer.ttt import TTTObjective, target_distribution, target_rows, ttt_unroll

VOCAB, WINDOW, PROMPT, NEW = 320, 16, 40, 24
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512)
MOE_KERNELS_FP32 = {"qwen3_moe", "gpt_oss", "deepseek_v3"}  # grouped-mm kernels refuse fp64


def family_config(name: str):
    c = dict(COMMON)
    if name == "llama":
        return T.LlamaConfig(**c, head_dim=16)
    if name == "qwen2_sliding":
        return T.Qwen2Config(**c, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=4)
    if name == "qwen3":
        return T.Qwen3Config(**c, head_dim=16)
    if name == "qwen3_moe":
        return T.Qwen3MoeConfig(**c, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    if name == "mistral_sliding":
        return T.MistralConfig(**c, head_dim=16, sliding_window=WINDOW)
    if name == "gemma2":
        return T.Gemma2Config(**c, head_dim=16, sliding_window=WINDOW, final_logit_softcapping=3.0,
                              attn_logit_softcapping=50.0)
    if name == "gemma3":
        return T.Gemma3TextConfig(**c, head_dim=16, sliding_window=WINDOW, sliding_window_pattern=2)
    if name == "phi3":
        return T.Phi3Config(**c, pad_token_id=0)
    if name == "gpt_oss":
        return T.GptOssConfig(**dict(c, intermediate_size=64), head_dim=16, sliding_window=WINDOW,
                              num_local_experts=4, num_experts_per_tok=2)
    if name == "deepseek_v3":  # MLA attention
        return T.DeepseekV3Config(**dict(c, num_key_value_heads=4), kv_lora_rank=32, q_lora_rank=48,
                                  qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
                                  num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                                  n_group=1, topk_group=1)
    if name == "gpt2":  # transformer.h, learned positions, LayerNorm
        return T.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=8, n_head=4, n_positions=512)
    if name == "cohere":  # logit_scale
        return T.CohereConfig(**c, logit_scale=0.25)
    if name == "granite":  # logits_scaling, embedding_multiplier
        return T.GraniteConfig(**c, logits_scaling=4.0, embedding_multiplier=2.0)
    if name == "phi":  # lm_head with a bias
        return T.PhiConfig(**dict(c, num_key_value_heads=4))
    raise KeyError(name)


FAMILIES = ["llama", "qwen2_sliding", "qwen3", "qwen3_moe", "mistral_sliding", "gemma2", "gemma3", "phi3",
            "gpt_oss", "deepseek_v3", "gpt2", "cohere", "granite", "phi"]
SLIDING = {"qwen2_sliding", "mistral_sliding", "gemma2", "gemma3", "gpt_oss"}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(name, model in its test dtype, saved folder). Weights scaled up a little so random targets
    have peaked, tie-free next-token distributions."""
    name = request.param
    torch.manual_seed(0)
    dtype = torch.float32 if name in MOE_KERNELS_FP32 else torch.float64
    model = T.AutoModelForCausalLM.from_config(family_config(name), attn_implementation="eager").eval()
    folder = tmp_path_factory.mktemp(name)
    model.save_pretrained(folder)
    return name, model.to(dtype), folder


def random_ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_layout_sees_every_sliding_window(family):
    name, model, _ = family
    layout = attention_layout(model)
    assert (WINDOW in layout.windows) == (name in SLIDING), layout
    if len(set(layout.types)) > 1:
        assert layout.per_type


def test_capture_equals_output_hidden_states(family):
    name, model, _ = family
    layers = default_aux_layers(8)
    ids = torch.tensor([random_ids(1, 30), random_ids(2, 22) + [0] * 8])
    att = torch.tensor([[1] * 30, [1] * 22 + [0] * 8])
    aux, last = capture_hidden(model, ids, att, layers)
    with torch.no_grad():
        hs = model(input_ids=ids, attention_mask=att, output_hidden_states=True).hidden_states
    want = torch.cat([hs[j + 1] for j in layers], dim=-1)
    for row, n in ((0, 30), (1, 22)):
        torch.testing.assert_close(aux[row, :n], want[row, :n], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(last[row, :n], hs[-1][row, :n], rtol=1e-5, atol=1e-6)


def test_training_logits_are_the_targets_logits(family):
    """captured last_hidden -> the trainer's target logits == the model's own logits (bias, soft-cap,
    logit scale included), through the same parts the trainer reads from the folder."""
    name, model, folder = family
    assert check_logit_rule(model, default_aux_layers(8)) < 1e-4
    parts = load_target_parts(folder)
    ids = torch.tensor([random_ids(3, 20)])
    _, last = capture_hidden(model, ids, None, default_aux_layers(8))
    with torch.no_grad():
        want = model(input_ids=ids).logits.float()
    torch.testing.assert_close(parts.logits(last.float()), want, rtol=1e-4, atol=1e-4)
    if name == "phi":
        assert parts.lm_bias is not None
    if name in ("gemma2", "cohere", "granite"):  # the transform matters: the plain product is wrong
        assert not torch.allclose(last.float() @ parts.lm_weight.float().T, want, atol=1e-3)


def random_head(model, seed=1):
    torch.manual_seed(seed)
    head = Eagle3Head(head_config_from_target(model.config, VOCAB)).to(model.dtype)
    with torch.no_grad():  # larger fc weights: the draft leans on the target's states, trees branch
        head.fc.weight.mul_(4.0)
    return head


def greedy_runs(name, model, head, seeds):
    """Tree and chain decodes of random prompts with `head`, each asserted token-identical to HF greedy
    generate (40 + 24 tokens: the window (16) slides four times); yields each decode's stats."""
    gen = EagleGenerator(model, None, head, default_aux_layers(8))
    gen.eos = set()
    for seed in seeds:
        ids = random_ids(seed, PROMPT)
        with torch.no_grad():
            want = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, PROMPT, dtype=torch.long),
                                  max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        want = want[0, PROMPT:].tolist()
        for mode in ("tree", "chain"):
            got = gen.generate(ids, SpecSettings(mode=mode, top_k=3, depth=4, total_tokens=10, max_new_tokens=NEW))
            assert got.tokens == want, (name, mode, seed)
            yield got.stats


def test_greedy_tree_and_chain_identical_to_hf(family):
    name, model, _ = family
    for stats in greedy_runs(name, model, random_head(model), range(10, 13)):
        assert stats.rounds < NEW  # drafts were verified, not just one token per round


def test_train_steps_bring_the_loss_down(family):
    """The trainer's per-step computation (target parts from the folder, target distribution, TTT loss)
    on this family's captured states: finite, and down at every one of 10 AdamW steps on one batch (the
    floor is the random target's entropy, ~13 nats summed over the steps, so the drop is small)."""
    name, model, folder = family
    parts = load_target_parts(folder)
    ids = torch.tensor([random_ids(4, 32), random_ids(5, 32)])
    aux, last = capture_hidden(model, ids, None, default_aux_layers(8))
    head = Eagle3Head(head_config_from_target(parts.config, VOCAB)).float()
    opt = torch.optim.AdamW(head.parameters(), lr=1e-3)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        need, row = target_rows(mask)
        p, am = target_distribution(parts.logits(last.float()[need]), head.t2d)
    objective = TTTObjective(head, ttt_length=3, decay=0.8)
    losses = []
    for _ in range(10):
        out = objective(aux.float(), parts.embed(ids).float(), p, am, row, mask)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        losses.append(float(out["loss"].detach()))
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < losses[0] - 0.2, losses


def test_ttt_logits_equal_decoder_chain_logits(family):
    """Train/inference equivalence: TTT step s at position i == the decoder's chain level s after it
    ingested positions 0..i, when the sequence continues with the chain's own tokens. Guards the position
    off-by-one (xserv bug D) that otherwise only an engine's tau would reveal."""
    name, model, _ = family
    head = random_head(model, seed=2)
    gen = EagleGenerator(model, None, head, default_aux_layers(8))
    i, depth = 17, 4
    ids = random_ids(6, i + 2)  # tokens 0..i+1: the draft ingests 0..i, token i+1 is the tree's root
    logits, aux = gen.target.forward(torch.tensor(ids[: i + 1]), torch.arange(i + 1), gen.target.new_cache())
    gen.draft.reset()
    hid, dlog = gen.draft.ingest(aux, torch.tensor(ids[1: i + 2]), torch.arange(i + 1))
    tree = gen.draft.build_tree(ids[i + 1], hid, dlog, i, 1, depth, depth + 1)
    chain = tree.tokens[1:].tolist()  # the drafted continuation, one token per level
    levels = gen.draft.level_logits
    assert len(chain) == depth and len(levels) == depth
    seq = torch.tensor([ids + chain])
    cap_aux, _ = capture_hidden(model, seq, None, default_aux_layers(8))
    torch.testing.assert_close(cap_aux[0, : i + 1], aux, rtol=1e-5, atol=1e-6)  # decoder hooks == capture
    with torch.no_grad():
        emb = torch.nn.functional.embedding(seq, model.get_input_embeddings().weight)
        steps = [head.logits(x) for x in ttt_unroll(head, cap_aux, emb, depth)]
    for s in range(depth):
        torch.testing.assert_close(steps[s][0, i], levels[s][0], rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{name}: TTT step {s} vs decoder level {s}: {m}")


def test_dflash_greedy_tree_and_chain_identical_to_hf(family):
    """A random DFlash head (trainer/dflash.py) decodes every family losslessly, as the EAGLE-3 head does."""
    from trainer.dflash import DFlashHead

    name, model, _ = family
    torch.manual_seed(3)
    cfg = head_config_from_target(model.config, VOCAB, kind="dflash", num_layers=2, block_size=5, mask_token_id=5)
    assert len(list(greedy_runs(name, model, DFlashHead(cfg).to(model.dtype), range(20, 22)))) == 4
