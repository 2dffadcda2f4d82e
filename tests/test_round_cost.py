"""Cost-sized trees (infer/round_cost.py): the width rule, the measured costs, and lossless output."""
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from infer.checks.sampling import random_head
from infer.generate import EagleGenerator, SpecSettings
from infer.round_cost import (Calibration, DraftGate, RoundCosts, RoundPlan, cost_width, measure_round_costs,
                              probe_tree, sized_width)
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


def test_measured_gain_scales_the_step_by_the_verify_it_measured():
    plan = RoundPlan(grow_threshold=0.5, base_ms=12.0, level_ms=1.0, node_ms=2.0, step_ms=10.0)
    # as predicted: a 4-node verify of 10 + 3 x 2 ms, the round 18 ms of it and more, ingest 2 ms to come
    assert math.isclose(plan.measured_gain(2, 4, round_ms=18.0, verify_ms=16.0), plan.gained(2, 3, 4))
    # everything twice as slow as when measured: the same gain, not a shut gate
    assert math.isclose(plan.measured_gain(2, 4, round_ms=36.0, verify_ms=32.0), plan.gained(2, 3, 4))
    # the draft alone slower than predicted (verify as predicted): the round's extra ms count in steps
    assert math.isclose(plan.measured_gain(2, 4, round_ms=28.0, verify_ms=16.0), 3 - 30 / 10)


def test_round_plan_gain_counts_tokens_over_plain_steps():
    plan = RoundPlan(grow_threshold=0.5, base_ms=12.0, level_ms=1.0, node_ms=2.0, step_ms=10.0)
    assert plan.round_ms(levels=3, nodes=4) == 12 + 2 * 1 + 3 * 2
    assert math.isclose(plan.gained(accepted=2, levels=3, nodes=4), 3 - 20 / 10)
    assert math.isclose(plan.gained(accepted=0, levels=1, nodes=1), 1 - 12 / 10)  # a root-only round loses


def test_calibration_follows_acceptance_and_decays_back():
    cal = Calibration(decay=0.5, prior=1.0)
    assert cal.factor == 1.0
    for _ in range(6):
        cal.record(accepted=0, expected=2.0)  # an overconfident draft: nothing it believed in was accepted
    assert cal.factor == pytest.approx(1 / (1 + 2 * (1 - 0.5 ** 6) / 0.5), rel=1e-6) and cal.factor < 0.3
    for _ in range(8):
        cal.record(accepted=3, expected=2.0)  # back in domain: more accepted than believed
    assert 1.3 < cal.factor <= cal.ceil
    cal.record(accepted=1000, expected=0.0)
    assert cal.factor == cal.ceil


def test_sized_width_uses_calibrated_pi_and_returns_raw_expectation():
    plan = RoundPlan(grow_threshold=0.3, base_ms=3.0, level_ms=0.0, node_ms=1.0, step_ms=3.0)
    scores = torch.tensor([0.05, 0.9, 0.3, 0.8]).log()  # any order
    n, expected = sized_width(plan, scores, levels=1, cap=5)
    assert n == 1 + cost_width(scores.sort(descending=True).values, 3.0, 1.0, 4) == 3
    assert expected == pytest.approx(0.9 + 0.8)
    low = RoundPlan(**{**plan.__dict__, "calibration": 0.1})  # pi 0.09 and 0.08: not worth a node
    assert sized_width(low, scores, levels=1, cap=5) == (1, 0.0)
    assert low.log_threshold() == pytest.approx(math.log(3.0)) and plan.log_threshold() == pytest.approx(math.log(0.3))


def replay(hits: list[int], belief: float, costs: RoundCosts, depth: int, adaptive: bool,
           gate: DraftGate | None = None):
    """Replays an acceptance trace through the adaptive policy's real parts (RoundPlan, Calibration,
    DraftGate, cost_width) on a chain: hits[i] = draft tokens the target would accept at the i-th position
    the decoder drafts from; the draft believes each level with probability `belief` (pi = belief^d).
    Predicted ms from `costs`; -> (tokens, ms, drafting rounds, rounds). adaptive=False: the fixed chain.
    gate: the DraftGate to use (a fresh one when None; the caller reads its state after)."""
    gate = DraftGate() if gate is None else gate
    tokens, ms, drafted, rounds = 0, 0.0, 0, 0
    base = costs.plan(0)
    while tokens < len(hits):
        rounds += 1
        if adaptive and not gate.drafts():
            tokens, ms = tokens + 1, ms + base.step_ms
            continue
        plan = RoundPlan(**{**base.__dict__, "calibration": gate.calibration.factor if adaptive else 1.0})
        levels = 1
        while adaptive and levels < depth and math.log(belief) * levels >= plan.log_threshold():
            levels += 1
        scores = torch.log(torch.tensor([belief ** (d + 1) for d in range(levels if adaptive else depth)]))
        nodes, expected = sized_width(plan, scores, levels, depth + 1) if adaptive else (depth + 1, 0.0)
        accepted = min(hits[min(tokens, len(hits) - 1)], nodes - 1)
        drafted += 1
        tokens, ms = tokens + 1 + accepted, ms + plan.round_ms(levels if adaptive else depth, nodes)
        if adaptive:
            gate.record(plan.gained(accepted, levels, nodes))
            gate.calibration.record(accepted, expected)
    return tokens, ms, drafted, rounds


# the demo target's shape of costs: a draft level ~20% of a target step, a verified node ~8%
DEMO_COSTS = RoundCosts(step=10.0, step_per_key=0.0, node=0.8, node_per_key=0.0, level=2.0, ingest=1.5)


def test_replayed_useless_draft_is_never_slower_than_the_target_alone():
    """A confident draft the target never accepts: the fixed chain pays every round; the adaptive policy
    backs off to plain steps, probing ever more rarely, and keeps >= 98% of the target's tokens per ms."""
    tokens, ms, drafted, rounds = replay([0] * 400, belief=0.9, costs=DEMO_COSTS, depth=5, adaptive=True)
    plain = tokens / (tokens * DEMO_COSTS.step)
    assert tokens / ms >= 0.98 * plain and drafted / rounds < 0.05
    f_tokens, f_ms, _, _ = replay([0] * 400, belief=0.9, costs=DEMO_COSTS, depth=5, adaptive=False)
    assert f_tokens / f_ms < 0.7 * plain  # what a fixed chain costs on such a trace


def test_replayed_useless_draft_stays_out_across_short_requests():
    """Twelve 48-token requests on which a confident draft is never accepted: a gate that starts afresh
    per request pays its first drafting rounds and probes again in each (below 98% of the target alone);
    `DraftGate.after` goes on from the last request's backoff and stays above 98%."""
    plain = 1 / DEMO_COSTS.step
    rates = {}
    for carry in (False, True):
        tokens = ms = 0.0
        last = None
        for _ in range(12):
            gate = DraftGate.after(last) if carry else DraftGate()
            t, m, _, _ = replay([0] * 48, belief=0.9, costs=DEMO_COSTS, depth=5, adaptive=True, gate=gate)
            tokens, ms, last = tokens + t, ms + m, gate
        rates[carry] = tokens / ms / plain
    assert rates[False] < 0.98 <= rates[True], rates
    # a request that lost in all hands on its backoff; one that paid in all, or a fresh one, nothing
    lost = DraftGate()
    lost.record(-0.5)
    lost.record(-0.5)  # a losing probe: backoff doubled
    nxt = DraftGate.after(lost)
    assert (nxt.plain_left, nxt.backoff, nxt.probing) == (4, 4, True) and not nxt.drafts()
    won = DraftGate()
    won.record(0.7)
    paid = DraftGate()
    for g in (2.0, 1.5, -1.5, -1.5):  # paid in all, though its last rounds lost
        paid.record(g)
    assert paid.score < 0 and paid.plain_left > 0
    assert DraftGate.after(won).plain_left == DraftGate.after(paid).plain_left == DraftGate.after(None).plain_left == 0


def test_replayed_trace_recovers_when_acceptance_returns():
    """Off-domain then in-domain: the adaptive policy drafts again after its probes see acceptance, and over
    the whole trace beats both the target alone and stays within 3% of the fixed chain on the good half."""
    bad, good = [0] * 200, [4] * 600
    tokens, ms, _, _ = replay(bad + good, belief=0.8, costs=DEMO_COSTS, depth=5, adaptive=True)
    assert tokens / ms > 1.5 / DEMO_COSTS.step
    g_tokens, g_ms, g_drafted, g_rounds = replay(good, belief=0.8, costs=DEMO_COSTS, depth=5, adaptive=True)
    f_tokens, f_ms, _, _ = replay(good, belief=0.8, costs=DEMO_COSTS, depth=5, adaptive=False)
    assert g_tokens / g_ms >= 0.97 * f_tokens / f_ms and g_drafted == g_rounds


def test_replayed_weak_draft_is_trimmed_to_what_pays():
    """A draft that believes 0.8 per level but gets one token accepted per round: calibration trims the
    chain to its first level and drafting pays (>= 1.05x the target alone) where the fixed chain of 5 loses."""
    tokens, ms, drafted, rounds = replay([1] * 600, belief=0.8, costs=DEMO_COSTS, depth=5, adaptive=True)
    f_tokens, f_ms, _, _ = replay([1] * 600, belief=0.8, costs=DEMO_COSTS, depth=5, adaptive=False)
    plain = 1 / DEMO_COSTS.step
    assert tokens / ms >= 1.05 * plain > f_tokens / f_ms and drafted / rounds > 0.9


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
    fixed = SpecSettings(top_k=3, depth=3, total_tokens=8, max_new_tokens=16, sizing="fixed")
    for ids in prompts(gen.tokenizer, demo_corpus, n=4):
        want = hf_greedy(gen.target.model, ids, 16)
        base = gen.generate(ids, fixed)
        gen.costs = free
        got = gen.generate(ids, fixed.model_copy(update={"sizing": "adaptive"}))
        assert got.tokens == want == base.tokens
        # every drafting round is the fixed tree; the gate (measured times) may still take plain steps
        drafted = got.stats.rounds - got.stats.plain_steps
        assert drafted >= 1 and len(got.stats.accepted) == drafted
        assert got.stats.nodes == 8 * drafted + got.stats.plain_steps and got.stats.levels == 3 * drafted
        gen.costs, gen.last_gate = dear, None  # every drafting round loses: most rounds become plain steps
        got = gen.generate(ids, fixed.model_copy(update={"sizing": "adaptive"}))
        assert got.tokens == want
        st = got.stats
        assert st.nodes == st.rounds == st.levels + st.plain_steps and sum(st.accepted) == 0
        # drafting rounds only at the backoff's probes: d, 2 plain, d, 4 plain, d, 8 plain, ...
        schedule = ("d" + "pp" + "d" + "pppp" + "d" + "p" * 8 + "d" + "p" * 16)[: st.rounds]
        assert len(st.accepted) == schedule.count("d") == st.rounds - st.plain_steps and st.plain_steps >= 2
        # the next request goes on from this one's gate: it opens with plain steps, not a losing round
        again = gen.generate(ids, fixed.model_copy(update={"sizing": "adaptive"}))
        assert again.tokens == want and again.stats.plain_steps > st.plain_steps and again.stats.rounds == st.rounds
        seeded = gen.generate(ids, fixed.model_copy(update={"sizing": "adaptive", "seed": 3}))
        assert seeded.tokens == want and seeded.stats.plain_steps == st.plain_steps  # a seed starts afresh
        gen.last_gate = None
    gen.costs = None


def test_seeded_sampling_repeats_under_the_adaptive_policy(random_generator, demo_corpus):
    """A seed fixes the adaptive policy's shapes (the gate's predicted gains, not the clock), so the same
    seed draws the same tokens from one generator; another seed draws others."""
    gen = random_generator
    gen.costs = RoundCosts(step=1.0, step_per_key=0.0, node=0.05, node_per_key=0.0, level=0.3, ingest=0.1)
    ids = prompts(gen.tokenizer, demo_corpus, n=1)[0]
    s = SpecSettings(top_k=3, depth=3, total_tokens=8, max_new_tokens=24, temperature=1.0, seed=11)
    runs = [gen.generate(ids, s) for _ in range(3)]
    other = gen.generate(ids, s.model_copy(update={"seed": 12}))
    gen.costs = None
    assert runs[0].tokens == runs[1].tokens == runs[2].tokens != other.tokens
    assert [r.stats.nodes for r in runs] == [runs[0].stats.nodes] * 3


def test_plain_steps_keep_the_draft_cache_in_step(random_generator, demo_corpus):
    """After plain steps and catch-up ingests the draft's cache holds what one ingest of the whole committed
    sequence writes: every skipped position's element came back, with its own next token and position."""
    gen = random_generator
    gen.costs = RoundCosts(step=1.0, step_per_key=0.0, node=50.0, node_per_key=0.0, level=50.0, ingest=1.0)
    ids = prompts(gen.tokenizer, demo_corpus, n=1)[0]
    got = gen.generate(ids, SpecSettings(top_k=3, depth=3, total_tokens=8, max_new_tokens=24, sizing="adaptive"))
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
