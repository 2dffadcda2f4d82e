"""Cost-sized trees (infer/round_cost.py): the width rule, the measured costs, and lossless output."""
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from infer.checks.sampling import random_head
from infer.generate import EagleGenerator, SpecSettings
from infer.round_cost import DraftGate, RoundCosts, RoundPlan, cost_width, measure_round_costs, probe_tree
from pipeline.target import default_aux_layers
from test_generate import hf_greedy, prompts
from test_pipeline_capture import make_random_target


def test_cost_width_maximises_tokens_per_ms():
    scores = torch.tensor([0.9, 0.8, 0.3, 0.05]).log()
    # by hand: gains 1, 1.9, 2.7, 3.0, 3.05 over costs 3, 4, 5, 6, 7 -> 0.333, 0.475, 0.54, 0.5, 0.436
    assert cost_width(scores, 3.0, 1.0, cap=4) == 2
    assert cost_width(scores, 3.0, 1.0, cap=1) == 1  # the cap binds
    assert cost_width(scores, 3.0, 0.0, cap=4) == 4  # free nodes: all of them
    assert cost_width(scores, 3.0, 100.0, cap=4) == 0  # dear nodes: the root alone (a plain step)
    assert cost_width(scores[:0], 3.0, 1.0, cap=4) == 0


def test_probe_tree_is_connected():
    t = probe_tree(9)
    assert t.parents.tolist() == [-1, 0, 0, 1, 1, 2, 2, 3, 3]
    assert t.depth.tolist() == [0, 1, 1, 2, 2, 2, 2, 3, 3]
    assert t.mask[8].nonzero().flatten().tolist() == [0, 1, 3, 8]


def test_draft_gate_backs_off_doubles_and_recovers():
    gate = DraftGate(decay=0.5, min_backoff=2, max_backoff=8)
    seen = []

    def run(gains):
        for g in gains:
            while not gate.drafts():
                seen.append("p")
            seen.append("d")
            gate.record(g)

    run([1.0, -0.5])  # average 0.25, still drafting
    run([-1.0])       # average -0.375: 2 plain steps, then a probe
    run([-0.1, -0.1, -0.1, -0.1])  # losing probes: 4, 8, 8, 8 plain steps (the cap)
    run([0.3, 0.2])   # a winning probe resets the backoff and drafting goes on
    run([-0.2])       # scored with the average again: 0.5 * 0.2 + 0.5 * -0.2 = 0, not below 0
    run([-0.4])       # below 0: 2 plain steps again (the reset backoff)
    assert "".join(seen) == "ddd" + "pp" + "d" + "pppp" + "d" + ("p" * 8 + "d") * 3 + "dd" + "d"
    assert gate.plain_left == 2


def test_round_plan_gain_counts_tokens_over_plain_steps():
    plan = RoundPlan(grow_threshold=0.5, base_ms=12.0, level_ms=1.0, node_ms=2.0, step_ms=10.0)
    assert plan.round_ms(levels=3, nodes=4) == 12 + 2 * 1 + 3 * 2
    assert math.isclose(plan.gained(accepted=2, levels=3, nodes=4), 3 - 20 / 10)
    assert math.isclose(plan.gained(accepted=0, levels=1, nodes=1), 1 - 12 / 10)  # a root-only round loses


@pytest.fixture(scope="module")
def random_generator(tiny_target, tmp_path_factory):
    folder = make_random_target("llama", tiny_target, tmp_path_factory.mktemp("cost") / "llama")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return EagleGenerator(model, AutoTokenizer.from_pretrained(folder), random_head(model.config, dtype=torch.float32),
                          default_aux_layers(model.config.num_hidden_layers))


def test_measured_costs_are_sane(random_generator):
    gen = random_generator
    c = measure_round_costs(gen.target, gen.draft, top_k=4, reps=3)
    step, node = c.at(100)
    assert 0 < step < 1000 and 0 <= node < step and 0 < c.level < 1000 and 0 < c.ingest < 1000
    plan = c.plan(100)
    assert math.isclose(plan.grow_threshold, (c.level + node) / step)
    assert gen.draft.cache.committed == 0  # the draft is left reset


def test_cost_sizing_regimes_on_random_head(random_generator, demo_corpus):
    """Free nodes and levels: the fixed tree exactly; prohibitive ones: a plain step per round; both
    token-identical to HF greedy."""
    gen = random_generator
    free = RoundCosts(step=1.0, step_per_key=0.0, node=0.0, node_per_key=0.0, level=0.0, ingest=0.0)
    dear = RoundCosts(step=1.0, step_per_key=0.0, node=50.0, node_per_key=0.0, level=50.0, ingest=1.0)
    fixed = SpecSettings(top_k=3, depth=3, total_tokens=8, max_new_tokens=16)
    for ids in prompts(gen.tokenizer, demo_corpus, n=4):
        want = hf_greedy(gen.target.model, ids, 16)
        base = gen.generate(ids, fixed)
        gen.costs = free
        got = gen.generate(ids, fixed.model_copy(update={"sizing": "cost"}))
        assert got.tokens == want == base.tokens
        assert (got.stats.accepted, got.stats.nodes, got.stats.levels) == \
            (base.stats.accepted, base.stats.nodes, base.stats.levels)
        assert got.stats.nodes == 8 * got.stats.rounds and got.stats.levels == 3 * got.stats.rounds
        gen.costs = dear  # every drafting round loses: the DraftGate turns most rounds into plain steps
        got = gen.generate(ids, fixed.model_copy(update={"sizing": "cost"}))
        assert got.tokens == want
        st = got.stats
        assert st.nodes == st.rounds == st.levels + st.plain_steps and sum(st.accepted) == 0
        # drafting rounds only at the backoff's probes: d, 2 plain, d, 4 plain, d, 8 plain, ...
        schedule = ("d" + "pp" + "d" + "pppp" + "d" + "p" * 8 + "d" + "p" * 16)[: st.rounds]
        assert len(st.accepted) == schedule.count("d") == st.rounds - st.plain_steps and st.plain_steps >= 2
    gen.costs = None


def test_plain_steps_keep_the_draft_cache_in_step(random_generator, demo_corpus):
    """After plain steps and catch-up ingests the draft's cache holds what one ingest of the whole committed
    sequence writes: every skipped position's element came back, with its own next token and position."""
    gen = random_generator
    gen.costs = RoundCosts(step=1.0, step_per_key=0.0, node=50.0, node_per_key=0.0, level=50.0, ingest=1.0)
    ids = prompts(gen.tokenizer, demo_corpus, n=1)[0]
    got = gen.generate(ids, SpecSettings(top_k=3, depth=3, total_tokens=8, max_new_tokens=24, sizing="cost"))
    gen.costs = None
    assert got.stats.plain_steps >= 8
    n = gen.draft.cache.committed
    assert len(ids) < n < len(ids) + len(got.tokens)
    seq = torch.tensor(ids + got.tokens)
    k_run = gen.draft.cache.k[:, :, :n].clone()
    cache = gen.target.new_cache()
    _, aux = gen.target.forward(seq[:n], torch.arange(n), cache)
    gen.draft.reset()
    gen.draft.ingest(aux, seq[1:n + 1], torch.arange(n))
    torch.testing.assert_close(k_run, gen.draft.cache.k[:, :, :n], rtol=1e-4, atol=1e-4)
