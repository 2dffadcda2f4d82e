"""The loss options of the TTT objective (ARCHITECTURE.md §6): LK losses, rejection weights, the per-token
mean, each against a by-hand or position-by-position reference."""
import pytest
import torch

from test_ttt import compact_targets, naive_ttt_loss, random_batch, tiny_head
from trainer.ttt import (LK_DECAY, TTTObjective, acceptance_rate, lk_losses, round_rejections, shift_left,
                         ttt_unroll)


def test_lk_losses_by_hand():
    """model.loss: alpha = sum_v min(p, q); lk_alpha = -log alpha per row; lk_hybrid = lam * KL + (1 - lam) * TV
    per row with lam = exp(-3 alpha), lam held constant in the backward pass; a dropped row weighs 0."""
    q = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8], [1 / 3, 1 / 3, 1 / 3]], dtype=torch.float64)
    logits = torch.log(q).requires_grad_(True)
    p = torch.tensor([[0.2, 0.3, 0.5], [0.1, 0.1, 0.8], [1.0, 0.0, 0.0]], dtype=torch.float64)
    w = torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64)  # the third row is dropped (off the draft vocab)
    alpha = torch.tensor([0.2 + 0.3 + 0.2, 1.0, 1 / 3], dtype=torch.float64)
    torch.testing.assert_close(acceptance_rate(logits, p).detach(), alpha)
    torch.testing.assert_close(lk_losses("lk_alpha", logits, p, w).detach(), -torch.log(alpha) * w)
    kl0 = float((p[0] * (p[0] / q[0]).log()).sum())
    lam = torch.exp(-LK_DECAY * alpha)
    hybrid = lk_losses("lk_hybrid", logits, p, w)
    torch.testing.assert_close(hybrid.detach(), torch.stack([lam[0] * kl0 + (1 - lam[0]) * 0.3, torch.zeros((), dtype=torch.float64),
                                                            torch.zeros((), dtype=torch.float64)]))
    (g,) = torch.autograd.grad(hybrid.sum(), logits)  # lam as a constant: the two terms' gradients, mixed
    logq = torch.log_softmax(logits, -1)
    kl = (p * (torch.log(p.clamp(min=1e-30)) - logq)).sum(-1)
    tv = 1 - torch.minimum(logq.exp(), p).sum(-1)
    ce_g = torch.autograd.grad((w * lam * kl).sum(), logits, retain_graph=True)[0]
    tv_g = torch.autograd.grad((w * (1 - lam) * tv).sum(), logits)[0]
    torch.testing.assert_close(g, ce_g + tv_g)
    with pytest.raises(ValueError, match="needs labels: soft"):
        TTTObjective(tiny_head(), 2, 0.8, labels="hard", loss="lk_hybrid")


@pytest.mark.parametrize("loss", ["lk_hybrid", "lk_alpha"])
def test_lk_losses_raise_acceptance_on_a_fixed_batch(loss):
    """Each LK loss trains: 30 AdamW steps on one batch lift the counted rows' mean acceptance (sum min(p, q))
    at step 0 from the untrained head's to well above it, and the objective's loss falls."""
    torch.manual_seed(4)
    b, t, steps = 3, 12, 2
    aux, emb = torch.randn(b, t, 96, dtype=torch.float64), torch.randn(b, t, 32, dtype=torch.float64)
    tlogits = torch.randn(b, t, 40, dtype=torch.float64) * 3
    mask = torch.ones(b, t, dtype=torch.long)
    head = tiny_head()
    objective = TTTObjective(head, steps, 0.8, off_vocab="keep", loss=loss)
    targets = compact_targets(tlogits, mask, head.t2d)

    def step0_alpha():
        with torch.no_grad():
            x = next(ttt_unroll(head, aux, emb, steps))
            sel = shift_left(mask, 2).bool()
            rows = shift_left(targets[2], 1, fill=-1)[sel]  # step 0 at i reads target position i + 1
            return float(acceptance_rate(head.logits(x[sel]), targets[0][rows]).mean())

    before, opt, curve = step0_alpha(), torch.optim.AdamW(head.parameters(), lr=1e-2), []
    for _ in range(30):
        out = objective(aux, emb, *targets, mask)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        curve.append(out["loss"].item())
    after = step0_alpha()
    assert after > before + 0.2 and curve[-1] < curve[0], (before, after, curve[0], curve[-1])


def test_round_rejections_by_hand():
    """Rounds along a run of loss tokens 3..8: the first starts at 2 (token 3 is the target's first, the bonus),
    accepts its leading right steps A and the next starts at i + A + 1; a round with A < L is rejected at
    step A unless the rejected token lies past the run."""
    def rows(accs):
        c = torch.zeros(1, 10, 3, dtype=torch.bool)
        for i, a in accs.items():
            c[0, i, :a] = True
        return c
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 0]])
    # i=2 accepts 1 (rejected at step 1, token 5), i=4 accepts 3 (all), i=8: token 10 is past the run
    got = round_rejections(rows({2: 1, 4: 3, 3: 3}), mask)
    assert got.nonzero().tolist() == [[0, 2, 1]]
    # i=2 accepts 1, i=4 accepts 0 (step 0), i=5 accepts 2: its rejected token 9 is past the run
    got = round_rejections(rows({2: 1, 4: 0, 5: 2}), mask)
    assert got.nonzero().tolist() == [[0, 2, 1], [0, 4, 0]]
    two = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 1, 1, 1]])  # two runs: 1..2 and 5..9
    got = round_rejections(rows({0: 0, 4: 0, 5: 1, 7: 0}), two)
    assert got.nonzero().tolist() == [[0, 0, 0], [0, 4, 0], [0, 5, 1], [0, 7, 0]]


def test_rejection_boost_weighs_the_rejected_rows():
    """model.rejection_boost b: the loss is the decay-weighted loss plus b x each rejected row's term (found
    from the naive loop's own draft argmaxes) x decay ** s / positions."""
    head = tiny_head()
    b, t, steps, decay = 2, 12, 3, 0.8
    aux, emb, tlogits, p, am = random_batch(head, b, t, 5)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1]])
    targets = compact_targets(tlogits, mask, head.t2d)
    terms = {}
    naive_ttt_loss(head, aux, emb, p, am, mask, steps, decay, "keep", terms_out=terms)
    right = torch.zeros(b, t, steps, dtype=torch.bool)
    for (bi, i, s), (_, ok) in terms.items():
        right[bi, i, s] = ok
    rejected = round_rejections(right, mask)
    assert int(rejected.sum()) >= 3
    extra = sum(decay ** s * terms[(bi, i, s)][0] for bi, i, s in rejected.nonzero().tolist()) / (b * t)
    base = TTTObjective(head, steps, decay, off_vocab="keep")(aux, emb, *targets, mask)["loss"].item()
    got = TTTObjective(head, steps, decay, off_vocab="keep", rejection_boost=2.0)(aux, emb, *targets, mask)["loss"].item()
    assert abs(got - (base + 2.0 * extra)) < 1e-9 and extra > 1e-3


def test_loss_norm_tokens_is_each_steps_mean():
    """model.loss_norm: tokens divides each step's row sum by the rows it counts (speculators' mean), not by
    every position: the loss is sum_s decay ** s x the mean of step s's terms."""
    head = tiny_head()
    b, t, steps = 2, 10, 3
    aux, emb, tlogits, p, am = random_batch(head, b, t, 6)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1, 1, 1, 1]])
    terms = {}
    naive_ttt_loss(head, aux, emb, p, am, mask, steps, 0.8, "keep", terms_out=terms)
    want = sum(0.8 ** s * sum(v[0] for k, v in terms.items() if k[2] == s) / sum(1 for k in terms if k[2] == s)
               for s in range(steps))
    got = TTTObjective(head, steps, 0.8, off_vocab="keep", loss_norm="tokens")(
        aux, emb, *compact_targets(tlogits, mask, head.t2d), mask)["loss"].item()
    assert abs(got - want) < 1e-9


@pytest.mark.parametrize("k", [6, 8])
def test_align_topk_counts_only_the_reached_chains(k):
    """model.align_topk k (GRIFFIN's mask): step s counts position i only where steps 0..s-1 at i were counted
    and ranked the target's token within their top k; the loss is the naive loop's terms on those rows."""
    head = tiny_head()
    b, t, steps, decay = 2, 12, 3, 0.8
    aux, emb, tlogits, p, am = random_batch(head, b, t, 7)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1]])
    terms, ranks = {}, {}
    naive_ttt_loss(head, aux, emb, p, am, mask, steps, decay, "drop", terms_out=terms, ranks_out=ranks)
    reached = {key for key in terms if all(ranks.get((key[0], key[1], s), k) < k for s in range(key[2]))}
    deep = [key for key in reached if key[2] > 0]
    assert len(deep) >= 2 and len(reached) < len(terms)
    want = sum(decay ** key[2] * terms[key][0] for key in reached) / (b * t)
    out = TTTObjective(head, steps, decay, align_topk=k)(aux, emb, *compact_targets(tlogits, mask, head.t2d), mask)
    assert abs(out["loss"].item() - want) < 1e-9
    base = TTTObjective(head, steps, decay)(aux, emb, *compact_targets(tlogits, mask, head.t2d), mask)
    assert abs(out["step_loss"][0].item() - base["step_loss"][0].item()) < 1e-12
