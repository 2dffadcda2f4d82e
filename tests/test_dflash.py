"""DFlash (trainer/dflash.py, trainer/dflash_objective.py, infer/dflash_draft.py): the block rules, training
and decoding computing the same block, export in vLLM's DFlashDraftModel format, lossless decoding."""
import json

import pytest
import torch
import transformers as T
from transformers import AutoModelForCausalLM, AutoTokenizer

from infer.dflash_draft import DFlashRunner
from infer.generate import EagleGenerator, SpecSettings
from pipeline.target import default_aux_layers
from test_export import spec
from test_generate import hf_greedy, prompts
from test_pipeline_capture import make_random_target
from trainer.dflash import DFlashHead, default_mask_token
from trainer.dflash_objective import (DFlashObjective, accepted_prefix, block_labels, block_mask, block_positions,
                                      sample_anchors)
from trainer.export import export_head, head_state, import_head
from trainer.head import head_config_from_target
from trainer.ttt import target_rows

VOCAB = 96


def dflash_head(tcfg, seed=0, layers=2, block=5, vocab=VOCAB, mask=7, causal=False) -> DFlashHead:
    """A random DFlash head whose norms are away from 1, so a norm applied twice or not at all shows."""
    torch.manual_seed(seed)
    cfg = head_config_from_target(tcfg, vocab, kind="dflash", num_layers=layers, block_size=block, mask_token_id=mask,
                                  block_causal=causal)
    head = DFlashHead(cfg).double()
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand_like(p) + 0.5)
    return head


def small_cfg(vocab=VOCAB):
    return T.Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)


def test_anchors_and_block_mask():
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 0, 1, 1], [0, 0, 0, 0, 0, 0, 1, 1, 0, 0]])
    gen = torch.Generator().manual_seed(0)
    anchors, keep = sample_anchors(mask, 16, gen)
    # candidates: a >= 1 with token a + 1 a loss token: row 0 -> 2,3,4,5,7,8; row 1 -> 5,6
    assert anchors.shape == (2, 6)
    assert anchors[0].tolist() == [2, 3, 4, 5, 7, 8] and keep[0].all()
    assert anchors[1, :2].tolist() == [5, 6] and keep[1].tolist() == [True, True] + [False] * 4
    few, _ = sample_anchors(mask, 3, gen)
    assert few.shape == (2, 3) and set(few[0].tolist()) <= {2, 3, 4, 5, 7, 8} and few[0].tolist() == sorted(few[0].tolist())
    bs, t = 3, 10
    m = block_mask(anchors, keep, t, bs)[:, 0]
    assert m.shape == (2, 6 * bs, t + 6 * bs)
    for b in range(2):
        for n in range(6):
            for k in range(bs):
                q = n * bs + k
                want_ctx = [bool(keep[b, n]) and j < int(anchors[b, n]) for j in range(t)]
                want_blk = [j // bs == n for j in range(6 * bs)]
                assert m[b, q].tolist() == want_ctx + want_blk, (b, n, k)
    causal = block_mask(anchors, keep, t, bs, causal=True)[:, 0]  # slot k sees its block's slots <= k only
    assert causal[0, 3 * bs + 1, t:].tolist() == [j in (3 * bs, 3 * bs + 1) for j in range(6 * bs)]
    assert torch.equal(causal[..., :t], m[..., :t]) and causal.sum() < m.sum()
    assert block_positions(anchors[:1, :2], bs).tolist() == [[2, 3, 4, 3, 4, 5]]
    need, row = target_rows(mask)
    rows, valid = block_labels(anchors, keep, row, bs)
    # block at anchor 5 of row 0: slot 1 reads position 5 (token 6: loss), slot 2 position 6 (token 7: not)
    assert valid[0, 3].tolist() == [True, False] and int(rows[0, 3, 0]) == int(row[0, 5])
    assert valid[0, 5].tolist() == [True, False]  # anchor 8: slot 2 reads position 9, past the row's end
    correct = torch.tensor([[[True, True, False], [True, False, True], [False, True, True]]])
    ok = torch.ones_like(correct)
    run, reached = accepted_prefix(correct, ok)
    assert run.tolist() == [[[True, True, False], [True, False, False], [False, False, False]]]
    assert reached.tolist() == [[[True, True, True], [True, True, False], [True, False, False]]]


@torch.no_grad()
@pytest.mark.parametrize("causal", [False, True])
def test_training_block_is_the_decoding_block(causal):
    """The training forward (many anchors, one masked pass) and the decoder (context cached by ingest, one
    block, masked only when causal) give the same logits for every block; the causal block differs."""
    head = dflash_head(small_cfg(), causal=causal)
    gen = torch.Generator().manual_seed(3)
    t = 24
    aux = torch.randn(1, t, 3 * 64, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (1, t), generator=gen)
    embed = torch.randn(VOCAB, 64, generator=gen, dtype=torch.float64)
    anchors, keep = torch.tensor([[1, 6, 13, 20]]), torch.ones(1, 4, dtype=torch.bool)
    bs = head.config.block_size
    x = embed[head.config.mask_token_id].expand(1, 4, bs, -1).clone()
    x[:, :, 0] = embed[ids[0, anchors[0]]]
    ctx = head.context_kv(aux, torch.arange(t)[None])
    out = head.block(x.flatten(1, 2), block_positions(anchors, bs), ctx, block_mask(anchors, keep, t, bs, causal))
    train_logits = head.logits(out.view(1, 4, bs, -1)[0, :, 1:])
    other = head.block(x.flatten(1, 2), block_positions(anchors, bs), ctx, block_mask(anchors, keep, t, bs, not causal))
    assert not torch.allclose(head.logits(other.view(1, 4, bs, -1)[0, :, 1:]), train_logits)
    runner = DFlashRunner(head, embed)
    for n, a in enumerate(anchors[0].tolist()):
        runner.reset()
        runner.ingest(aux[0, :a], ids[0, 1:a + 1], torch.arange(a))
        got = runner.block_logits(int(ids[0, a]), a - 1, bs - 1)
        torch.testing.assert_close(got, train_logits[n], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("labels,dpace,loss", [("soft", None, "kl"), ("hard", 0.5, "kl"), ("soft", None, "lk_hybrid")])
def test_objective_learns_a_fixed_batch(labels, dpace, loss):
    """The soft loss with the fixed decay, hard labels with D-PACE slot weights (DFlash's default, which
    scores the batch differently), and the LK hybrid loss all fit a fixed batch."""
    head = dflash_head(small_cfg()).float()
    gen = torch.Generator().manual_seed(1)
    b, t = 2, 40
    aux = torch.randn(b, t, 192, generator=gen)
    emb = torch.randn(b, t, 64, generator=gen)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[:, :5] = 0
    need, row = target_rows(mask)
    n = int(need.sum())
    target_logits = 4 * torch.randn(n, VOCAB, generator=gen)
    p, am = torch.softmax(target_logits, -1), target_logits.argmax(-1)
    obj = DFlashObjective(head, torch.randn(64, generator=gen), anchors=16, decay_gamma=4.0, labels=labels,
                          dpace_alpha=dpace, loss=loss)
    if dpace or loss != "kl":
        base = DFlashObjective(head, obj.mask_embedding, anchors=16, decay_gamma=4.0).eval()
        with torch.no_grad():
            assert abs(float(obj.eval()(aux, emb, p, am, row, mask)["loss"]) -
                       float(base(aux, emb, p, am, row, mask)["loss"])) > 0.1
        obj.train()
    opt = torch.optim.Adam(obj.parameters(), lr=3e-3)
    first = None
    for _ in range(60):
        out = obj(aux, emb, p, am, row, mask)
        first = first if first is not None else float(out["loss"].detach())
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
    obj.eval()
    with torch.no_grad():
        out = obj(aux, emb, p, am, row, mask)
    assert float(out["loss"]) < 0.5 * first
    assert out["step_loss"].shape == (4,) and out["step_count"][0] == 32  # 2 rows x 16 anchors reach slot 1
    assert float(out["step_correct"][0]) / float(out["step_count"][0]) > 0.8


def test_dpace_total_by_hand():
    """Two blocks of three slots, the second block's last slot past its row: each counted slot's loss times
    its D-PACE weight (test_ttt's by hand: 1.875, 1.125, 0.375 and 1.5, 0.75, 0) over the 5 counted slots."""
    obj = DFlashObjective(dflash_head(small_cfg()), torch.zeros(64), anchors=2, decay_gamma=4.0, dpace_alpha=0.5)
    elems = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]), torch.tensor([5.0])]
    valid = torch.tensor([[[True, True, True], [True, True, False]]])
    conf = torch.tensor([[[0.5, 1.0, 0.0], [0.5, 1.0, 0.0]]])
    want = (1.875 * 1 + 1.5 * 2 + 1.125 * 3 + 0.75 * 4 + 0.375 * 5) / 5
    assert abs(float(obj._total(elems, conf, valid)) - want) < 1e-6


def test_default_mask_token_skips_zero_rows_and_specials():
    emb = torch.randn(10, 4)
    emb[9] = 0
    assert default_mask_token(emb, {8}) == 7
    assert default_mask_token(emb, set()) == 8


def test_export_is_vllms_dflash_format_and_imports_back(tmp_path):
    head = dflash_head(small_cfg(), vocab=40).float()
    state = head_state(head)
    out = export_head(state, head.config, [1, 3, 6], spec(8), tmp_path / "d", "dflash")
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["DFlashDraftModel"] and conf["model_type"] == "qwen3"
    assert conf["num_hidden_layers"] == 2 and conf["block_size"] == 5
    assert conf["dflash_config"] == {"mask_token_id": 7, "target_layer_ids": [1, 3, 6], "causal": False}
    assert conf["eagle_aux_hidden_state_layer_ids"] == [2, 4, 7]
    back, cfg, aux = import_head(out, 8)
    assert aux == [1, 3, 6] and cfg == head.config
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    assert "layers.1.self_attn.k_norm.weight" in back
    full = dflash_head(small_cfg(), vocab=VOCAB).float()  # the target's whole vocabulary: no d2t shipped
    out2 = export_head(head_state(full), full.config, [1, 3, 6], spec(8), tmp_path / "full", "dflash")
    from safetensors.torch import load_file, save_file
    assert "d2t" not in load_file(str(out2 / "model.safetensors"))
    assert import_head(out2, 8)[0]["d2t"].abs().sum() == 0
    with pytest.raises(ValueError, match="a dflash head exports as dflash"):
        export_head(state, head.config, [1, 3, 6], spec(8), tmp_path / "x", "speculators")
    # refused at load, one line naming the tensor or key
    bad = dict(load_file(str(out / "model.safetensors")))
    bad["layers.1.self_attn.k_norm.weight"] = torch.ones(8)
    save_file(bad, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.k_norm\.weight has shape \(8,\)"):
        import_head(out, 8)
    export_head(state, head.config, [1, 3, 6], spec(8), out, "dflash")
    conf["eagle_aux_hidden_state_layer_ids"] = [2, 4, 6]
    (out / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match="target_layer_ids .* and eagle_aux_hidden_state_layer_ids .* different"):
        import_head(out, 8)
    conf["eagle_aux_hidden_state_layer_ids"] = [2, 4, 7]
    (out / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match="out of range"):
        import_head(out, 6)  # a target of 6 layers has no layer 6
    conf["num_hidden_layers"] = 3
    (out / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match=r"missing \['layers\.2\."):
        import_head(out, 8)


def test_causal_block_and_speculators_dflash_configs_import(tmp_path):
    """A causal-block head exports `dflash_config.causal: true` and imports back causal; a speculators DFlash
    checkpoint (its layer config, aux ids as inputs of layers, causal sliding layers) imports as vLLM 0.32
    converts it; a sliding window shorter than the head's positions and mixed layer kinds are refused."""
    head = dflash_head(small_cfg(), vocab=40, causal=True).float()
    state = head_state(head)
    out = export_head(state, head.config, [1, 3, 6], spec(8), tmp_path / "c", "dflash")
    conf = json.loads((out / "config.json").read_text())
    assert conf["dflash_config"]["causal"] is True and import_head(out, 8)[1] == head.config
    layer = {k: v for k, v in conf.items() if k not in ("architectures", "dflash_config", "block_size",
                                                          "eagle_aux_hidden_state_layer_ids", "draft_vocab_size")}
    layer["rope_parameters"] = {"rope_type": "default", "rope_theta": 50000.0}  # transformers 5: theta in here
    layer.pop("rope_theta", None)
    spec_conf = {"architectures": ["DFlashDraftModel"], "speculators_model_type": "dflash", "block_size": 5,
                 "draft_vocab_size": 40, "mask_token_id": 7, "aux_hidden_state_layer_ids": [2, 4, 7],
                 "target_hidden_size": None, "sliding_window_non_causal": False,
                 "transformer_layer_config": {**layer, "layer_types": ["sliding_attention"] * 2,
                                              "sliding_window": layer["max_position_embeddings"]}}
    (out / "config.json").write_text(json.dumps(spec_conf))
    back, cfg, aux = import_head(out, 8)
    assert aux == [1, 3, 6] and cfg.block_causal and cfg.rope_parameters["rope_theta"] == 50000.0
    assert cfg.block_size == 5 and cfg.mask_token_id == 7 and all(torch.equal(back[k], state[k]) for k in state)
    spec_conf["sliding_window_non_causal"] = True
    (out / "config.json").write_text(json.dumps(spec_conf))
    assert not import_head(out, 8)[1].block_causal
    spec_conf["transformer_layer_config"]["sliding_window"] = 64
    (out / "config.json").write_text(json.dumps(spec_conf))
    with pytest.raises(ValueError, match="sliding_window 64: a window shorter than"):
        import_head(out, 8)
    conf["dflash_config"].pop("causal")
    conf["layer_types"] = ["sliding_attention", "full_attention"]
    (out / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match="layer_types: causal and non-causal layers mixed"):
        import_head(out, 8)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_token_identical_random_dflash_head(arch, tmp_path, tiny_target, demo_corpus):
    folder = make_random_target(arch, tiny_target, tmp_path / arch)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    head = dflash_head(model.config, vocab=model.config.vocab_size)
    gen = EagleGenerator(model, tok, head, default_aux_layers(8))
    assert isinstance(gen.draft, DFlashRunner)
    for i, ids in enumerate(prompts(tok, demo_corpus, 12)):
        want = hf_greedy(model, ids, 20)
        for mode, k in (("tree", 3), ("chain", 1)):
            got = gen.generate(ids, SpecSettings(mode=mode, top_k=k, depth=4, total_tokens=8, max_new_tokens=20))
            assert got.tokens == want, (arch, mode, i)


@pytest.mark.slow
def test_trained_dflash_head_learns_exports_and_decodes_losslessly(tiny_dflash_head, tiny_target, demo_corpus):
    report = json.loads((tiny_dflash_head / "report.json").read_text())
    assert report["kind"] == "dflash" and set(report["exports"]) == {"dflash"}
    assert sum(report["last_loss"]) < sum(report["first_loss"]), report
    history = json.loads((tiny_dflash_head / "history.json").read_text())
    evals = [h for h in history if "sim_tau" in h]
    assert evals[0]["step"] == 0 and evals[-1]["sim_tau"] > evals[0]["sim_tau"] + 0.3, evals
    gen = EagleGenerator.from_folders(tiny_target, tiny_dflash_head / "head_dflash", dtype=torch.float64)
    model = gen.target.model
    taus = {}
    for mode, k, total in (("tree", 3, 10), ("chain", 1, 5)):
        stats = []
        for i, ids in enumerate(prompts(gen.tokenizer, demo_corpus, 16)):
            want = hf_greedy(model, ids, 40)
            got = gen.generate(ids, SpecSettings(mode=mode, top_k=k, depth=4, total_tokens=total, max_new_tokens=40,
                                                 sizing="fixed"))  # tau of the head, not of this machine's timing
            assert got.tokens == want, (mode, i)
            stats.append(got.stats)
        taus[mode] = stats[0].pooled_tau(stats)
    print(taus, evals[-1]["sim_tau"])
    # An untrained head decodes at ~1.0. The chain's tau on these corpus prompts: 1.28 / 1.33 / 1.37 at data
    # seeds 0 / 1 / 2; 1.24 (tree 1.74) with DFlash's hard labels and D-PACE at seed 0, so the bound sits below.
    assert taus["chain"] > 1.2 and taus["tree"] > taus["chain"], taus


@pytest.mark.slow
def test_sampling_with_a_dflash_tree_keeps_the_target_distribution():
    """T=0.8, top_p=0.9 on the peaked vocab-48 target: speculative draws through a random DFlash head's
    trees vs the exact joint distribution (infer/checks/sampling.py's chi-square), as for EAGLE-3."""
    from infer.checks.sampling import peaky_llama, run_check

    model = peaky_llama()
    head = dflash_head(model.config, vocab=48, block=3, mask=1)
    res = run_check(model, head, 5000, workers=2)
    print(res)
    assert res["impossible"] == 0 and res["accepted"] > 0.03 * 5000
    assert res["cells"] >= 10 and res["p_value"] > 0.01


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_layers_init_copies_the_targets_last_layers(tmp_path, tiny_target, arch):
    """model.layers_init: target: the DFlash layers start as the target's last layers and its final norm
    (q/k norms too where the target has them, at its projections' size where it has none); an EAGLE-3 layer
    from the last one."""
    from trainer.config import Model
    from trainer.warm_start import run_head_config, starting_head

    target = make_random_target(arch, tiny_target, tmp_path / arch)
    model = AutoModelForCausalLM.from_pretrained(target).float()
    with torch.no_grad():  # norms away from one, so a copied norm is told from a fresh one
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(target)
    n = model.config.num_hidden_layers
    m = Model(kind="dflash", num_layers=2, layers_init="target")
    d2t, t2d = torch.zeros(VOCAB, dtype=torch.long), torch.zeros(model.config.vocab_size, dtype=torch.bool)
    t2d[:VOCAB] = True
    emb = model.get_input_embeddings().weight.detach()
    hcfg = run_head_config(m, model.config, VOCAB, emb)
    head = starting_head(m, hcfg, d2t, t2d, model.lm_head.weight.detach(), n, target)
    for j, src in enumerate(model.model.layers[n - 2:]):
        got = dict(head.layers[j].named_parameters())
        for name, p in src.named_parameters():
            assert torch.equal(got[name], p), (j, name)
        if arch == "llama":  # no q/k norms in the target: the head's at the size its projections give
            for p in "qk":
                w, g = getattr(src.self_attn, f"{p}_proj").weight, src.input_layernorm.weight
                size = (w.pow(2) * g.pow(2)).sum(1).mean().sqrt()
                assert torch.allclose(got[f"self_attn.{p}_norm.weight"], size.expand(hcfg.head_dim)), (j, p)
                assert abs(size.item() - 1) > 0.05  # tells it from a fresh norm
    assert torch.equal(head.norm.weight, model.model.norm.weight)
    fresh = starting_head(Model(kind="dflash", num_layers=2), hcfg, d2t, t2d, model.lm_head.weight.detach(), n)
    assert not torch.equal(fresh.layers[1].mlp.up_proj.weight, model.model.layers[n - 1].mlp.up_proj.weight)
    # EAGLE-3: the one layer from the target's last; q/k/v's hidden half is the target's, its embedding half 0
    m3 = Model(layers_init="target")
    h3 = starting_head(m3, run_head_config(m3, model.config, VOCAB, emb), d2t, t2d, model.lm_head.weight.detach(),
                       n, target)
    last, h = model.model.layers[n - 1], model.config.hidden_size
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight", "post_attention_layernorm.weight"):
        assert torch.equal(h3.midlayer.get_parameter(name), last.get_parameter(name)), name
    for name in ("q_proj", "k_proj", "v_proj"):
        w = getattr(h3.midlayer.self_attn, name).weight
        assert torch.equal(w[:, h:], getattr(last.self_attn, name).weight) and not w[:, :h].any(), name
    assert torch.equal(h3.midlayer.hidden_norm.weight, last.input_layernorm.weight)
    assert torch.equal(h3.norm.weight, model.model.norm.weight)
    # fc_init: high: the fused state is the high aux state itself
    mh = Model(layers_init="target", fc_init="high")
    hh = starting_head(mh, run_head_config(mh, model.config, VOCAB, emb), d2t, t2d, model.lm_head.weight.detach(),
                       n, target)
    aux = torch.randn(5, 3 * h)
    assert torch.equal(hh.features(aux), aux[:, 2 * h:]) and not torch.equal(h3.features(aux), aux[:, 2 * h:])
    # DFlash: the context is the high aux state under the first copied layer's input norm
    md = Model(kind="dflash", num_layers=2, layers_init="target", fc_init="high")
    hd = starting_head(md, hcfg, d2t, t2d, model.lm_head.weight.detach(), n, target)
    first = model.model.layers[n - 2].input_layernorm.weight
    assert torch.equal(hd.hidden_norm.weight, first) and not torch.equal(head.hidden_norm.weight, first)
    assert torch.equal(hd.fc(aux), aux[:, 2 * h:]) and not torch.equal(head.fc(aux), aux[:, 2 * h:])
