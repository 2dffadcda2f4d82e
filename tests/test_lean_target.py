"""The lean target forward (infer/cpu/lean.py) is the HF forward: same logits, same aux states, same
K/V after a tree verify and its compaction, and greedy decoding token-identical to HF generate; families
it does not know, and models whose forward it would not reproduce, keep the HF forward."""
from __future__ import annotations

import pytest
import torch
import transformers as T

from infer.generate import EagleGenerator, SpecSettings
from infer.cpu import choose_target
from infer.cpu.lean import LeanTarget, lean_unsupported
from infer.target import TargetRunner
from infer.tree import Candidates, compaction_indices, finalize
from pipeline.hidden import capture_hidden
from pipeline.target import default_aux_layers
from trainer.head import Eagle3Head, head_config_from_target

VOCAB = 320
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
LEAN = {
    "llama": lambda: T.LlamaConfig(**COMMON, head_dim=16, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}),
    "qwen2": lambda: T.Qwen2Config(**COMMON),  # q/k/v biases
    "qwen3": lambda: T.Qwen3Config(**COMMON, head_dim=16),  # q/k norms
    "mistral": lambda: T.MistralConfig(**COMMON, head_dim=16, sliding_window=None),
}


def tiny(config) -> T.PreTrainedModel:
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # peaked, tie-free next-token distributions
        for p in model.parameters():
            p.mul_(3.0) if p.dim() == 2 else None
    return model


@pytest.fixture(scope="module", params=sorted(LEAN))
def lean_model(request):
    return request.param, tiny(LEAN[request.param]())


def lean_of(model, aux_ids: list[int]) -> LeanTarget | None:
    return choose_target(model, aux_ids)[0]


def ids_of(seed: int, n: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def test_prefill_logits_and_aux_equal_hf(lean_model):
    name, model = lean_model
    aux_ids = default_aux_layers(8)
    lean = lean_of(model, aux_ids)
    assert lean is not None, name
    ids = ids_of(1, 30)
    logits, aux = lean.forward(ids, torch.arange(30), lean.new_cache())
    with torch.no_grad():
        want = model(input_ids=ids[None]).logits[0]
    want_aux, _ = capture_hidden(model, ids[None], None, aux_ids)
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(aux, want_aux[0], atol=1e-5, rtol=1e-5)
    last, _ = lean.forward(ids, torch.arange(30), lean.new_cache(), last_only=True)
    torch.testing.assert_close(last, want[-1:], atol=1e-4, rtol=1e-4)


def test_verify_and_compaction_equal_a_fresh_forward(lean_model):
    """Prefill, verify a 2-branch tree whose second branch is accepted, compact, step once more: the
    cache and that step's logits equal an HF forward over the committed sequence."""
    name, model = lean_model
    runner = TargetRunner(model, default_aux_layers(8))
    assert runner.lean is not None
    ids = ids_of(2, 20)
    cache = runner.new_cache()
    logits, _ = runner.forward(ids, torch.arange(20), cache)
    root = int(logits[-1].argmax())
    tree = finalize(root, Candidates([5, 6, 7], [-1, -1, 1], [-0.1, -0.2, -0.3], [1, 1, 2]), [0, 1, 2])
    runner.forward(tree.tokens, tree.positions(20), cache, runner.verify_masks(tree, 20))
    accepted = [0, 2, 3]  # root, token 6, its child 7
    src, dst = compaction_indices(20, accepted)
    runner.compact(cache, src, dst, 20 + len(accepted))
    committed = torch.cat([ids, torch.tensor([root, 6, 7])])
    assert cache.length == len(committed)
    nxt, _ = runner.forward(torch.tensor([11]), torch.tensor([len(committed)]), cache)
    with torch.no_grad():
        want = model(input_ids=torch.cat([committed, torch.tensor([11])])[None]).logits[0, -1]
    torch.testing.assert_close(nxt[0], want, atol=1e-4, rtol=1e-4)


def test_cache_grows_past_its_capacity(lean_model):
    name, model = lean_model
    lean = lean_of(model, default_aux_layers(8))
    cache = lean.new_cache()
    cache.kv = cache.kv[:, :, :, :8].clone()  # a small capacity, so the 20-token prefill overflows it
    ids = ids_of(3, 20)
    logits, _ = lean.forward(ids, torch.arange(20), cache)
    assert cache.kv.shape[3] >= 20 and cache.length == 20
    with torch.no_grad():
        torch.testing.assert_close(logits, model(input_ids=ids[None]).logits[0], atol=1e-4, rtol=1e-4)


def test_greedy_tree_on_lean_forward_identical_to_hf_generate(lean_model):
    name, model = lean_model
    torch.manual_seed(1)
    head = Eagle3Head(head_config_from_target(model.config, VOCAB))
    gen = EagleGenerator(model, None, head, default_aux_layers(8))
    gen.eos = set()
    assert gen.target.lean is not None
    for seed in range(2):
        ids = ids_of(10 + seed, 24).tolist()
        with torch.no_grad():
            want = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, 24, dtype=torch.long),
                                  max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
        s = SpecSettings(mode="tree", top_k=3, depth=4, total_tokens=10, max_new_tokens=20)
        got = gen.generate(ids, s)
        assert got.tokens == want[0, 24:].tolist(), (name, seed)


def test_other_families_keep_the_hf_forward():
    sliding = tiny(T.MistralConfig(**COMMON, head_dim=16, sliding_window=8))
    assert "sliding" in lean_unsupported(sliding)
    runner = TargetRunner(sliding, default_aux_layers(8))
    assert runner.lean is None and runner.path.name == "generic" and "sliding" in runner.path.reason
    gemma = tiny(T.Gemma2Config(**COMMON, head_dim=16, sliding_window=8))
    assert "gemma2" in lean_unsupported(gemma)
    granite = tiny(T.GraniteConfig(**COMMON, embedding_multiplier=2.0))
    assert lean_of(granite, default_aux_layers(8)) is None  # llama-shaped, scaled: not a lean family


def test_probe_refuses_a_forward_the_lean_path_would_not_reproduce():
    """A llama whose decoder layers were changed in a way the lean loop does not see: the probe's logits
    differ, so the runner keeps the HF forward (and HF's answer)."""
    model = tiny(LEAN["llama"]())
    layer = model.model.layers[3]
    plain = layer.forward
    layer.forward = lambda *a, **kw: (lambda out: out * 1.5)(plain(*a, **kw))
    lean = LeanTarget(model, default_aux_layers(8))
    assert lean.probe() is not None and "differ" in lean.probe()
    runner = TargetRunner(model, default_aux_layers(8))
    assert runner.lean is None and runner.path.name == "generic" and "differ" in runner.path.reason
