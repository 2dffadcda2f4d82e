"""Logprobs from the decoder: entry i is the target's own raw log-softmax at the position that emitted
tokens[i] (the prefill's last row, a plain step's row, or the verify row of an accepted node), the same
as a plain HF forward gives; asking for them changes no token; every cut keeps them aligned."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from infer.checks.sampling import peaky_llama, random_head
from infer.generate import EagleGenerator, SpecSettings
from infer.round_cost import RoundCosts
from pipeline.target import default_aux_layers

PROMPT = [5, 9, 17, 3]
# vocab 48: a wide tree gets the random head's drafts accepted (about one token in three here)
TREE = SpecSettings(mode="tree", top_k=8, depth=3, total_tokens=24, max_new_tokens=40, sizing="fixed")
CHAIN = TREE.model_copy(update={"mode": "chain", "depth": 3})


@pytest.fixture(scope="module")
def gen():
    model = peaky_llama()  # float64: the verify rows equal a plain forward's far below 1e-5
    return EagleGenerator(model, None, random_head(model.config), [0, 1, 2])


def reference(model, prompt: list[int], out: list[int]) -> torch.Tensor:
    """log_softmax (float32) of one plain HF forward of prompt + out: row i scores out[i]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out], device=model.device)).logits[0, len(prompt) - 1: -1]
    return torch.log_softmax(logits.float(), dim=-1).cpu()


def assert_exact(model, prompt: list[int], g, k: int):
    assert g.logprobs is not None and len(g.logprobs) == len(g.tokens)
    ref = reference(model, prompt, g.tokens)
    for i, (t, (lp, top)) in enumerate(zip(g.tokens, g.logprobs)):
        assert abs(lp - float(ref[i, t])) < 1e-5, i
        vals, ids = torch.topk(ref[i], k)
        assert [a for a, _ in top] == ids.tolist(), i
        torch.testing.assert_close(torch.tensor([v for _, v in top]), vals, atol=1e-5, rtol=0)


def decode(gen, s: SpecSettings, k: int | None, prompt=PROMPT):
    """(with logprobs k, without): asking for logprobs must not change a token."""
    g, plain = gen.generate(prompt, s.model_copy(update={"logprobs": k})), gen.generate(prompt, s)
    assert g.tokens == plain.tokens and g.finish_reason == plain.finish_reason
    assert plain.logprobs is None
    return g


@pytest.mark.parametrize("s", [TREE, CHAIN], ids=["tree", "chain"])
def test_greedy_logprobs_are_the_targets(gen, s):
    g = decode(gen, s, 3)
    assert sum(g.stats.accepted) > 0  # verify rows of accepted draft nodes scored tokens, not only bonuses
    assert_exact(gen.target.model, PROMPT, g, 3)
    g0 = decode(gen, s, 0)
    assert all(top == [] for _, top in g0.logprobs) and [lp for lp, _ in g0.logprobs] == [lp for lp, _ in g.logprobs]


def test_plain_steps_and_vanilla(gen):
    """The plain step's row: vanilla decoding, and cost sizing's plain steps between drafting rounds."""
    assert_exact(gen.target.model, PROMPT, decode(gen, TREE.model_copy(update={"mode": "vanilla"}), 2), 2)
    gen.costs = RoundCosts(step=1.0, step_per_key=0.0, node=50.0, node_per_key=0.0, level=50.0, ingest=1.0)
    try:  # every drafting round loses: most rounds become plain steps
        g = decode(gen, TREE.model_copy(update={"sizing": "adaptive"}), 2)
    finally:
        gen.costs = None
    assert g.stats.plain_steps > 2
    assert_exact(gen.target.model, PROMPT, g, 2)


def test_cuts_keep_logprobs_aligned(gen):
    """max_new_tokens and EOS cutting a round's tokens cut its logprobs the same way."""
    full = decode(gen, TREE, 2)
    mid = 0
    for n in range(1, 13):
        g = decode(gen, TREE.model_copy(update={"max_new_tokens": n}), 2)
        assert g.tokens == full.tokens[:n] and len(g.logprobs) == n and g.finish_reason == "length"
        assert_exact(gen.target.model, PROMPT, g, 2)
        mid += g.stats.cut_mid_round
    in_tree = 0
    try:
        for i, t in enumerate(full.tokens[:12]):
            if t in full.tokens[:i]:
                continue
            gen.eos = {t}
            g = decode(gen, TREE, 2)
            assert g.finish_reason == "eos" and g.tokens == full.tokens[: i + 1] and len(g.logprobs) == i + 1
            assert_exact(gen.target.model, PROMPT, g, 2)
            in_tree += g.stats.eos_in_tree
    finally:
        gen.eos = set()
    assert mid > 0 and in_tree > 0  # both cuts fell inside a round's accepted tokens


def test_seeded_sampling_keeps_tokens_and_raw_logprobs(gen):
    """T > 0: the same seed draws the same tokens with logprobs asked; the entries are the raw target's,
    not the temperature / top-p warped distribution the tokens were drawn from."""
    accepted = 0
    for seed in range(4):
        s = TREE.model_copy(update={"temperature": 0.8, "top_p": 0.9, "seed": seed, "max_new_tokens": 24})
        g = decode(gen, s, 4)
        assert_exact(gen.target.model, PROMPT, g, 4)
        accepted += sum(g.stats.accepted)
    assert accepted > 0


def test_stream_snapshots_carry_the_list_so_far(gen):
    snaps = list(gen.stream(PROMPT, TREE.model_copy(update={"logprobs": 1})))
    final = snaps[-1]
    assert len(snaps) > 2
    for snap in snaps:
        assert len(snap.logprobs) == len(snap.tokens) and snap.logprobs == final.logprobs[: len(snap.tokens)]


def test_stop_string_cut_on_a_real_tokenizer(tiny_target):
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float64).eval()
    tok = AutoTokenizer.from_pretrained(tiny_target)
    g = EagleGenerator(model, tok, random_head(model.config), default_aux_layers(8))
    ids = tok.apply_chat_template([{"role": "user", "content": "Write a Python function that returns the sum."}],
                                  add_generation_prompt=True, return_dict=True)["input_ids"]
    s = SpecSettings(mode="tree", top_k=3, depth=3, total_tokens=8, max_new_tokens=40, sizing="fixed")
    full = decode(g, s, 2, ids)
    assert_exact(model, ids, full, 2)
    text = tok.decode(full.tokens, skip_special_tokens=True)
    cut = decode(g, s.model_copy(update={"stop": [text[len(text) // 2: len(text) // 2 + 3]]}), 2, ids)
    assert cut.finish_reason == "stop" and len(cut.logprobs) == len(cut.tokens) < len(full.tokens)
    assert cut.logprobs == full.logprobs[: len(cut.tokens)]
