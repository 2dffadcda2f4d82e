"""TTT masks, positions and loss (ARCHITECTURE.md §6), without Ray."""
import pytest
import torch
from torch._dynamo.utils import counters

from trainer.head import Eagle3Head
from trainer.ttt import (TTTObjective, dpace_weights, position_losses, row_argmax, shift_left, simulated_tau,
                         step_loss, target_distribution, target_rows, ttt_attention, ttt_attention_mask,
                         ttt_positions, ttt_unroll)
from trainer.ttt_flash import ttt_attention_flash

# Step 3, T=6, hand-written: keys are step 0 (causal), then steps 1, 2, 3 (same position only).
STEP3 = [
    "100000 100000 100000 100000",
    "110000 010000 010000 010000",
    "111000 001000 001000 001000",
    "111100 000100 000100 000100",
    "111110 000010 000010 000010",
    "111111 000001 000001 000001",
]


def parse(rows):
    return torch.tensor([[c == "1" for c in r.replace(" ", "")] for r in rows])


@pytest.mark.parametrize("step", [0, 1, 2, 3])
def test_mask_and_positions_by_hand(step):
    want = parse([" ".join(r.split()[: step + 1]) for r in STEP3])
    assert torch.equal(ttt_attention_mask(6, step), want)
    assert ttt_positions(6, step).tolist() == [step + i for i in range(6)]


def dense_attention(q, keys, vals, s):
    """The reference: softmax over the dense [T, T * (s + 1)] mask of ttt_attention_mask."""
    dense_k, dense_v = torch.cat(keys, dim=2), torch.cat(vals, dim=2)
    scores = q @ dense_k.transpose(-1, -2) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~ttt_attention_mask(q.shape[2], s), float("-inf"))
    return torch.softmax(scores, -1) @ dense_v


def attention_inputs(s, dtype, b=2, h=3, t=6, d=8, seed=0):
    torch.manual_seed(seed)
    make = lambda: torch.randn(b, h, t, d, dtype=torch.float64).to(dtype).requires_grad_()  # noqa: E731
    return make(), [make() for _ in range(s + 1)], [make() for _ in range(s + 1)]


def run_attention(kind, q, keys, vals):
    if kind == "flash":
        return ttt_attention_flash(q, keys, vals)
    t = q.shape[2]
    return ttt_attention(q, keys, vals, torch.full((t, t), float("-inf"), dtype=q.dtype).triu(1))


@pytest.mark.parametrize("kind", ["blocked", "flash"])
@pytest.mark.parametrize("s", [0, 1, 3])
def test_ttt_attention_equals_dense_mask(kind, s):
    """Both kernels, values and gradients, against the dense mask in fp64 (T=13 spans flash's tiles
    unevenly; step 0 has no diagonal keys)."""
    q, keys, vals = attention_inputs(s, torch.float64, t=13)
    got, want = run_attention(kind, q, keys, vals), dense_attention(q, keys, vals, s)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    # The gradients too: the blocked backward (one split of the softmax) and the flash one (the kernel's
    # backward handed the merged out and log-sum-exp) are the dense one's.
    w = torch.randn_like(got)
    inputs = [q, *keys, *vals]
    for a, b_ in zip(torch.autograd.grad((got * w).sum(), inputs), torch.autograd.grad((want * w).sum(), inputs)):
        torch.testing.assert_close(a, b_, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_flash_attention_in_training_dtypes(dtype, tol):
    """fp32 and bf16 (DeepSpeed's two dtypes) against the fp64 dense reference, gradients included."""
    q, keys, vals = attention_inputs(2, dtype, t=40, d=16)
    got = ttt_attention_flash(q, keys, vals)
    assert got.dtype == dtype
    ref = [x.detach().double().requires_grad_() for x in (q, *keys, *vals)]
    want = dense_attention(ref[0], ref[1:4], ref[4:], 2)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    w = torch.randn_like(want)
    for a, b_ in zip(torch.autograd.grad((got.double() * w).sum(), [q, *keys, *vals]),
                     torch.autograd.grad((want * w).sum(), ref)):
        torch.testing.assert_close(a.double(), b_, atol=tol * 4, rtol=tol * 4)


def test_flash_refused_where_the_kernel_does_not_run():
    head = tiny_head().half()
    aux, emb = torch.randn(1, 5, 96, dtype=torch.half), torch.randn(1, 5, 32, dtype=torch.half)
    with pytest.raises(ValueError, match="model.attention: flash"):
        next(ttt_unroll(head, aux, emb, 2, flash=True))


def test_row_argmax_takes_the_first_maximum_like_argmax():
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -1.0, -3.0]])
    assert row_argmax(x).tolist() == x.argmax(-1).tolist() == [1, 0, 0]
    big = torch.randn(64, 8192).round(decimals=1)  # many ties at the top
    assert torch.equal(row_argmax(big), big.argmax(-1))


def test_shift_and_tau():
    x = torch.tensor([[1, 2, 3, 4]])
    assert shift_left(x, 1).tolist() == [[2, 3, 4, 0]]
    assert shift_left(x, 5).tolist() == [[0, 0, 0, 0]]
    assert simulated_tau([0.5, 0.5]) == 1.75
    assert simulated_tau([1.0, 1.0, 1.0]) == 4.0


def tiny_head(vocab=40, draft=24):
    from trainer.head import head_config_from_target
    from transformers import LlamaConfig

    tcfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, vocab_size=vocab, max_position_embeddings=128, num_hidden_layers=8)
    torch.manual_seed(0)
    head = Eagle3Head(head_config_from_target(tcfg, draft)).double()
    used = torch.sort(torch.randperm(vocab)[:draft]).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    head.set_vocab(used - torch.arange(draft), t2d)
    return head


def random_batch(head, b: int, t: int, seed: int):
    """fp64 aux states, embeddings and target logits for `head` (tiny_head's sizes), with the target's
    draft-vocab distribution and argmax."""
    torch.manual_seed(seed)
    aux, emb = torch.randn(b, t, 96, dtype=torch.float64), torch.randn(b, t, 32, dtype=torch.float64)
    tlogits = torch.randn(b, t, 40, dtype=torch.float64) * 3
    return aux, emb, tlogits, torch.softmax(tlogits[..., head.t2d], -1), tlogits.argmax(-1)


def naive_ttt_loss(head, aux, emb, target_p, target_am, loss_mask, steps, decay, off_vocab="drop", hard=False,
                   dpace=None, terms_out=None, ranks_out=None):
    """Position by position, step by step: each query's keys listed explicitly. dpace: each start position's
    steps weighed by sum_{j>=s, counted} prod_{i<=j} ((1 - dpace) * p_i + dpace), p_i the draft's
    probability of the target's top draft-vocab token at step i (1 where step i is not counted)."""
    b, t, _ = emb.shape
    attn = head.midlayer.self_attn
    total = 0.0
    terms = {}  # (bi, i) -> {s: (loss, confidence)}
    denoms = []
    h = head.fc(aux)
    ks, vs = [], []
    for s in range(steps):
        e = torch.cat([emb[:, 1 + s:], torch.zeros_like(emb[:, : 1 + s])], 1)
        pos = torch.arange(t).unsqueeze(0).expand(b, t) + s
        q, k, v = head.qkv(h, e, pos)
        ks.append(attn.expand(k))
        vs.append(attn.expand(v))
        out = torch.zeros_like(q)
        for bi in range(b):
            for i in range(t):
                kk = torch.cat([ks[0][bi, :, : i + 1]] + [kx[bi, :, i: i + 1] for kx in ks[1:]], dim=1)
                vv = torch.cat([vs[0][bi, :, : i + 1]] + [vx[bi, :, i: i + 1] for vx in vs[1:]], dim=1)
                sc = (q[bi, :, i: i + 1] @ kk.transpose(-1, -2)) / q.shape[-1] ** 0.5
                out[bi, :, i: i + 1] = torch.softmax(sc, -1) @ vv
        x = head.finish(h, out)
        logits = head.logits(x)
        loss_s = 0.0
        for bi in range(b):
            for i in range(t):
                j = i + 1 + s
                if j >= t or i + 2 + s >= t or not loss_mask[bi, i + 2 + s]:
                    continue
                lp = torch.log_softmax(logits[bi, i], -1)
                top = int(target_p[bi, j].argmax())
                keep = off_vocab == "keep" or bool(head.t2d[target_am[bi, j]])
                term = (-lp[top] if hard else -(target_p[bi, j] * lp).sum()) * keep
                terms.setdefault((bi, i), {})[s] = (term, float(lp[top].detach().exp()))
                if terms_out is not None:  # (row, position, step) -> (term, draft argmax == target argmax)
                    d = int(lp.argmax())
                    terms_out[(bi, i, s)] = (float(term), d + int(head.d2t[d]) == int(target_am[bi, j]))
                if ranks_out is not None:  # (row, position, step) -> the target argmax's rank in the draft's order
                    ids = lp.argsort(descending=True)
                    hit = ((ids + head.d2t[ids]) == target_am[bi, j]).nonzero()
                    ranks_out[(bi, i, s)] = int(hit[0]) if len(hit) else len(ids)
                loss_s = loss_s + term
        denoms.append(b * t)
        total = total + decay ** s * loss_s / denoms[-1]
        h = x
    if dpace is None:
        return total
    total = 0.0
    for chain in terms.values():
        for s, (term, _) in chain.items():
            w = 0.0
            for j in range(s, steps):
                if j in chain:
                    prod = 1.0
                    for i in range(j + 1):
                        prod *= (1 - dpace) * chain[i][1] + dpace if i in chain else 1.0
                    w += prod
            total = total + w * term / denoms[s]
    return total


def compact_targets(tlogits, mask, t2d):
    """The trainer's target table: distribution and argmax only where a TTT step reads them."""
    need, row = target_rows(mask)
    p, am = target_distribution(tlogits[need], t2d)
    return p, am, row


def test_batched_loss_equals_naive_loop():
    head = tiny_head()
    torch.manual_seed(1)
    b, t, steps = 2, 9, 4
    aux = torch.randn(b, t, 96, dtype=torch.float64)
    emb = torch.randn(b, t, 32, dtype=torch.float64)
    tlogits = torch.randn(b, t, 40, dtype=torch.float64) * 3
    p = torch.softmax(tlogits[..., head.t2d], -1)
    am = tlogits.argmax(-1)
    mask = torch.randint(0, 2, (b, t))
    got = TTTObjective(head, steps, 0.8)(aux, emb, *compact_targets(tlogits, mask, head.t2d), mask)
    want = naive_ttt_loss(head, aux, emb, p, am, mask, steps, 0.8)
    assert abs(got["loss"].item() - want.item()) < 1e-5 and want.item() > 0
    # The per-step loss helper on rows, against the formula.
    lg, w = torch.randn(5, 24, dtype=torch.float64), torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    pr = torch.softmax(torch.randn(5, 24, dtype=torch.float64), -1)
    assert torch.isclose(step_loss(lg, pr, w, 7), -(w * (pr * torch.log_softmax(lg, -1)).sum(-1)).sum() / 7)


@pytest.mark.parametrize("off_vocab,labels,dpace", [
    ("keep", "soft", None), ("drop", "hard", None), ("drop", "soft", 0.5), ("keep", "hard", 0.3)])
def test_loss_switches_equal_naive_loop(off_vocab, labels, dpace):
    """model.off_vocab / labels / position_weight: dpace against the position-by-position loss (counted
    and dropped positions, a gap in the loss mask); each changes the loss."""
    head = tiny_head()
    b, t, steps = 2, 10, 3
    aux, emb, tlogits, p, am = random_batch(head, b, t, 2)
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1, 1, 0, 0, 0]])
    assert not head.t2d[am[mask.bool()]].all()  # some counted targets lie outside the draft vocab
    targets = compact_targets(tlogits, mask, head.t2d)
    got = TTTObjective(head, steps, 0.8, off_vocab=off_vocab, labels=labels, dpace_alpha=dpace)(
        aux, emb, *targets, mask)
    want = naive_ttt_loss(head, aux, emb, p, am, mask, steps, 0.8, off_vocab, labels == "hard", dpace)
    base = TTTObjective(head, steps, 0.8)(aux, emb, *targets, mask)["loss"].item()
    assert abs(got["loss"].item() - want.item()) < 1e-6 and abs(got["loss"].item() - base) > 1e-3


def test_dpace_weights_and_position_losses_by_hand():
    conf = torch.tensor([[0.5, 1.0, 0.0], [0.5, 1.0, 0.0]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    # smoothed 0.75, 1, 0.5: running products 0.75, 0.75, 0.375; an uncounted slot adds 0 and weighs 0
    assert torch.allclose(dpace_weights(conf, valid, 0.5), torch.tensor([[1.875, 1.125, 0.375], [1.5, 0.75, 0.0]]))
    assert torch.equal(dpace_weights(conf, valid, 1.0), torch.tensor([[3.0, 2.0, 1.0], [2.0, 1.0, 0.0]]))
    logits = torch.randn(4, 6, dtype=torch.float64)
    p = torch.softmax(torch.randn(4, 6, dtype=torch.float64) * 2, -1)
    w = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    soft, conf = position_losses(logits, p, w)
    hard, _ = position_losses(logits, p, w, hard=True)
    torch.testing.assert_close(soft.sum() / 9, step_loss(logits, p, w, 9))
    torch.testing.assert_close(hard, w * torch.nn.functional.cross_entropy(logits, p.argmax(-1), reduction="none"))
    torch.testing.assert_close(conf, torch.softmax(logits, -1).gather(1, p.argmax(-1)[:, None]).squeeze(1))


def test_target_rows_cover_exactly_what_steps_read():
    mask = torch.tensor([[0, 0, 1, 1, 0, 1], [1, 1, 1, 0, 0, 0]])
    need, row = target_rows(mask)
    assert need.tolist() == [[False, True, True, False, True, False], [True, True, False, False, False, False]]
    assert row.tolist() == [[-1, 0, 1, -1, 2, -1], [3, 4, -1, -1, -1, -1]]


def dense_objective(head, aux, emb, tlogits, mask, steps, decay):
    """The trainer's objective as it was before positions were selected: every position through the
    draft lm_head and a [B, T, Vd] loss; the reference the sparse objective must equal."""
    p, am = target_distribution(tlogits, head.t2d)
    total = 0.0
    for s, x in enumerate(ttt_unroll(head, aux, emb, steps)):
        logits = head.logits(x)
        tgt_am = shift_left(am, 1 + s)
        pm = shift_left(mask, 2 + s).to(logits.dtype) * head.t2d[tgt_am].to(logits.dtype)
        logp = torch.log_softmax(logits, dim=-1)
        total = total + decay ** s * -(pm.unsqueeze(-1) * shift_left(p, 1 + s) * logp).sum(-1).mean()
    return total


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 1e-5)])
def test_flash_attention_keeps_the_loss_curve(dtype, tol):
    """Same seed, same batch, 8 AdamW steps: the objective on the flash kernel and on the blocked one give
    the same loss at every step, and the loss falls."""
    torch.manual_seed(4)
    b, t, steps = 3, 23, 5
    aux = torch.randn(b, t, 96, dtype=dtype)
    emb = torch.randn(b, t, 32, dtype=dtype)
    tlogits = torch.randn(b, t, 40, dtype=dtype) * 3
    mask = (torch.rand(b, t) < 0.7).long()
    curves = {}
    for attention in ("flash", "blocked"):
        head = tiny_head().to(dtype)
        objective = TTTObjective(head, steps, 0.8, attention)
        opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
        targets = compact_targets(tlogits, mask, head.t2d)
        curve = []
        for _ in range(8):
            loss = objective(aux, emb, *targets, mask)["loss"]
            opt.zero_grad()
            loss.backward()
            opt.step()
            curve.append(loss.item())
        curves[attention] = curve
    assert max(abs(a - d) for a, d in zip(curves["flash"], curves["blocked"])) < tol, curves
    assert curves["flash"][-1] < curves["flash"][0] - 0.1, curves


def test_sparse_objective_keeps_the_loss_curve():
    """Same seed, same batch, 8 AdamW steps: the position-selected objective and the dense one give the
    same loss at every step (fp64: to 1e-9) while the loss falls."""
    torch.manual_seed(3)
    b, t, steps = 3, 11, 4
    aux = torch.randn(b, t, 96, dtype=torch.float64)
    emb = torch.randn(b, t, 32, dtype=torch.float64)
    tlogits = torch.randn(b, t, 40, dtype=torch.float64) * 3
    mask = (torch.rand(b, t) < 0.6).long()
    curves = []
    for sparse in (True, False):
        head = tiny_head()
        objective = TTTObjective(head, steps, 0.8)
        opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
        targets = compact_targets(tlogits, mask, head.t2d)
        curve = []
        for _ in range(8):
            loss = (objective(aux, emb, *targets, mask)["loss"] if sparse
                    else dense_objective(head, aux, emb, tlogits, mask, steps, 0.8))
            opt.zero_grad()
            loss.backward()
            opt.step()
            curve.append(loss.item())
        curves.append(curve)
    sparse_curve, dense_curve = curves
    assert max(abs(a - d) for a, d in zip(sparse_curve, dense_curve)) < 1e-9, (sparse_curve, dense_curve)
    assert sparse_curve[-1] < sparse_curve[0] - 0.1, sparse_curve


@pytest.mark.slow  # torch.compile of the objective takes minutes on 2 cores
def test_compiled_objective_keeps_the_loss_curve():
    """model.compile: the objective's pieces through torch.compile (inductor on CPU here) give the eager
    objective's loss at every AdamW step, fp32 to 1e-5, over two batch shapes (the second one recompiles)."""
    torch.manual_seed(5)
    batches = []
    for b, t in ((2, 19), (3, 27)):
        mask = (torch.rand(b, t) < 0.7).long()
        batches.append((torch.randn(b, t, 96), torch.randn(b, t, 32), torch.randn(b, t, 40) * 3, mask))
    curves = {}
    counters.clear()
    for compiled in (False, True):
        head = tiny_head().float()
        objective = TTTObjective(head, 3, 0.8, "flash", compile=compiled)
        opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
        curve = []
        for aux, emb, tlogits, mask in batches * 3:
            loss = objective(aux, emb, *compact_targets(tlogits, mask, head.t2d), mask)["loss"]
            opt.zero_grad()
            loss.backward()
            opt.step()
            curve.append(loss.item())
        curves[compiled] = curve
    assert counters["stats"]["unique_graphs"] >= 4, dict(counters["stats"])  # compiled, not run eagerly
    assert max(abs(a - c) for a, c in zip(curves[False], curves[True])) < 1e-5, curves
    assert curves[True][-2] < curves[True][0] - 0.05, curves  # the first batch's loss falls
