"""Speculative generation is lossless: token-identical to HF greedy generate; sampling keeps p exactly."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from infer.checks.sampling import random_head
from infer.generate import EagleGenerator, SpecSettings
from infer.tree import Candidates, accept_greedy, compaction_indices, finalize, verify_mask
from pipeline.target import default_aux_layers
from test_pipeline_capture import make_random_target


def prompts(tok, demo_corpus, n=50):
    recs = [json.loads(x) for x in (demo_corpus / "train.jsonl").open()]
    users = [next(m["value"] for m in r["conversations"] if m["from"] == "human") for r in recs[:n]]
    return [tok.apply_chat_template([{"role": "user", "content": u}], add_generation_prompt=True,
                                    return_dict=True)["input_ids"] for u in users]


def hf_greedy(model, ids, n):
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_token_identical_random_targets(arch, tmp_path, tiny_target, demo_corpus):
    folder = make_random_target(arch, tiny_target, tmp_path / arch)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    gen = EagleGenerator(model, tok, random_head(model.config), default_aux_layers(8))
    for i, ids in enumerate(prompts(tok, demo_corpus)):
        want = hf_greedy(model, ids, 20)
        for mode in ("tree", "chain"):
            got = gen.generate(ids, SpecSettings(mode=mode, top_k=3, depth=3, total_tokens=8, max_new_tokens=20))
            assert got.tokens == want, (arch, mode, i)


@pytest.mark.slow
def test_greedy_identical_with_trained_head(tiny_target, tiny_head, demo_corpus):
    gen = EagleGenerator.from_folders(tiny_target, tiny_head, dtype=torch.float64)
    model = gen.target.model
    eos_in_tree = cut = accepted = 0
    for i, ids in enumerate(prompts(gen.tokenizer, demo_corpus)):
        n = 7 if i % 5 == 0 else 48  # short limits end generation inside a round
        want = hf_greedy(model, ids, n)
        for mode, k, total in (("tree", 4, 12), ("chain", 1, 5)):
            # fixed: the edge cases counted below need whole trees, not the adaptive policy's timing
            got = gen.generate(ids, SpecSettings(mode=mode, top_k=k, depth=4, total_tokens=total, max_new_tokens=n,
                                                 sizing="fixed"))
            assert got.tokens == want, (mode, i)
            eos_in_tree += got.stats.eos_in_tree
            cut += got.stats.cut_mid_round
            accepted += sum(got.stats.accepted)
    assert eos_in_tree > 0 and cut > 0 and accepted > 50


def test_eos_past_max_new_tokens_is_not_kept():
    """A round can accept tokens beyond max_new_tokens; an EOS among those must not extend the output
    (found by a better-trained tiny head: one token more than HF's greedy)."""
    gen = EagleGenerator.__new__(EagleGenerator)
    gen.eos, gen.tokenizer = {2}, None
    s = SpecSettings(max_new_tokens=3)
    assert gen._finish([5, 6, 7, 2], s) == ([5, 6, 7], "length")
    assert gen._finish([5, 2, 7, 9], s) == ([5, 2], "eos")
    assert gen._finish([5, 6, 2], s) == ([5, 6, 2], "eos")
    assert gen._finish([5, 6], s) == ([5, 6], None)


def cache_rows(gen, cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Committed K and V of one layer [1, kv_heads, length, head_dim], whichever cache the runner owns."""
    if gen.target.lean is not None:
        return cache.kv[layer, 0, None, :, :cache.length], cache.kv[layer, 1, None, :, :cache.length]
    return cache.layers[layer].keys, cache.layers[layer].values


@pytest.mark.parametrize("cpu_path", ["auto", "generic"])
def test_kv_after_second_branch_equals_fresh_forward(tiny_target, cpu_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_target)
    gen = EagleGenerator(model, tok, random_head(model.config, dtype=torch.float32), default_aux_layers(8),
                         cpu_path)
    assert (gen.target.lean is not None) == (cpu_path == "auto")
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of Kaloria?"}],
                                  add_generation_prompt=True, return_dict=True)["input_ids"]
    cache, plen = gen.target.new_cache(), len(ids)
    logits, aux = gen.target.forward(torch.tensor(ids), torch.arange(plen), cache)
    root = int(logits[-1].argmax())
    gen.draft.ingest(aux, torch.tensor(ids[1:] + [root]), torch.arange(plen))
    # The target's next two greedy tokens, offered as the SECOND child of the root (a wrong token first).
    ref = hf_greedy(model, ids, 4)
    assert ref[0] == root
    wrong = (ref[1] + 1) % len(tok)
    cands = Candidates([wrong, ref[1], ref[2]], [-1, -1, 1], [-0.1, -0.2, -0.3], [1, 1, 2])
    tree = finalize(root, cands, [0, 1, 2])
    logits, aux = gen.target.forward(tree.tokens, tree.positions(plen), cache, verify_mask(tree, plen, torch.float32))
    accepted, bonus = accept_greedy(tree, logits.argmax(-1))
    assert accepted == [0, 2, 3] and bonus == ref[3]
    src, dst = compaction_indices(plen, accepted)
    gen.target.compact(cache, src, dst, plen + len(accepted))
    committed = ids + [root, ref[1], ref[2]]
    fresh = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.tensor([committed]), past_key_values=fresh, use_cache=True)
    cfg = model.config
    for layer, b in enumerate(fresh.layers):
        keys, values = cache_rows(gen, cache, layer)
        assert keys.shape == b.keys.shape == (1, cfg.num_key_value_heads, len(committed), cfg.head_dim)
        torch.testing.assert_close(keys, b.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(values, b.values, atol=1e-5, rtol=1e-5)
    # The next step on the compacted cache sees the committed sequence only, as a fresh forward does.
    nxt, _ = gen.target.forward(torch.tensor([bonus]), torch.tensor([len(committed)]), cache)
    assert int(nxt[-1].argmax()) == hf_greedy(model, committed + [bonus], 1)[0]
    gen.draft.ingest(aux[torch.tensor(accepted)], torch.tensor([ref[1], ref[2], bonus]), plen + torch.arange(3))
    assert gen.draft.cached == len(committed)  # committed positions only, no tree leftovers


@pytest.mark.slow
def test_sampling_matches_target_distribution():
    """vocab 48 target, T=0.8, top_p=0.9: 8k speculative draws of the next 3 tokens vs the exact joint
    distribution under the same warpers (infer/checks/sampling.py: chi-square over cells expected >= 5)."""
    from infer.checks.sampling import peaky_llama, run_check

    model = peaky_llama()
    n = 8000  # 20k took 240 s of the suite on a 2-core EPYC, 12k 136-155 s; 8k still fills >= 10 cells
    # (257 seen); two processes draw the same 8k seeds as one, in 41 s instead of 79 s
    res = run_check(model, random_head(model.config, seed=1), n, workers=2)  # the 2 cores CI has
    print(res)
    assert res["impossible"] == 0  # never a sequence the target cannot sample
    assert res["accepted"] > 0.05 * n  # drafts really were accepted (about 9% of draws), not only bonus tokens
    assert res["cells"] >= 10 and res["p_value"] > 0.01


def test_chi_square_p_value_matches_scipy():
    """check_sampling's chi-square (torch's regularised gamma, for machines without scipy) equals scipy's."""
    import collections

    from infer.checks.sampling import chi_square
    from scipy.stats import chisquare

    joint = {(0, 0, 0): 0.5, (0, 0, 1): 0.3, (1, 0, 0): 0.15, (1, 1, 1): 0.05}
    counts = collections.Counter({(0, 0, 0): 520, (0, 0, 1): 275, (1, 0, 0): 160, (1, 1, 1): 45})
    res = chi_square(counts, joint, 1000, min_expected=60)  # the last cell (50 expected) goes to the rest
    want = chisquare([520, 275, 160, 45], [500, 300, 150, 50])
    assert res["cells"] == 3 and res["dof"] == 3
    assert abs(res["chi2"] - want.statistic) < 1e-3 and abs(res["p_value"] - want.pvalue) < 1e-4


def test_stop_string_cuts_inside_a_round(tiny_target):
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float64).eval()
    tok = AutoTokenizer.from_pretrained(tiny_target)
    gen = EagleGenerator(model, tok, random_head(model.config), default_aux_layers(8))
    ids = tok.apply_chat_template([{"role": "user", "content": "Write a Python function that returns the sum."}],
                                  add_generation_prompt=True, return_dict=True)["input_ids"]
    full = hf_greedy(model, ids, 40)
    text = tok.decode(full, skip_special_tokens=True)
    stop = text[len(text) // 2: len(text) // 2 + 3]
    got = gen.generate(ids, SpecSettings(mode="tree", top_k=3, depth=3, total_tokens=8, max_new_tokens=40, stop=[stop]))
    assert got.finish_reason == "stop" and got.tokens == full[: len(got.tokens)]
    assert stop in got.text and stop not in tok.decode(got.tokens[:-1], skip_special_tokens=True)


@pytest.mark.slow
def test_cost_sized_trees_are_lossless_and_sized(tiny_target, tiny_head, demo_corpus):
    """`sizing: adaptive` with this machine's measured costs: token-identical to HF greedy, and the rounds
    really vary in size between the root alone and the caps."""
    gen = EagleGenerator.from_folders(tiny_target, tiny_head, dtype=torch.float64)
    s = SpecSettings(mode="tree", top_k=4, depth=5, total_tokens=16, max_new_tokens=32, sizing="adaptive")
    nodes, rounds, accepted = 0, 0, 0
    for i, ids in enumerate(prompts(gen.tokenizer, demo_corpus, n=20)):
        got = gen.generate(ids, s)
        assert got.tokens == hf_greedy(gen.target.model, ids, 32), i
        nodes, rounds, accepted = nodes + got.stats.nodes, rounds + got.stats.rounds, accepted + sum(got.stats.accepted)
    assert gen.costs is not None and gen.costs.level > 0
    assert 1 < nodes / rounds < 16 and accepted > 20
