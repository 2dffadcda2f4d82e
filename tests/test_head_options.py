"""EAGLE 3.1 head options (trainer/head.py HEAD_OPTIONS): each changes the math, trains and decodes alike,
exports with the names vLLM and speculators read, and imports back, a peer's defaults included."""
import json

import pytest
import torch
import transformers as T

from infer.generate import EagleGenerator, SpecSettings
from pipeline.hidden import capture_hidden
from pipeline.target import default_aux_layers
from test_export import spec
from trainer.export import export_head, head_keys, head_state, import_head
from trainer.head import HEAD_OPTIONS, Eagle3Head, head_config_from_target
from trainer.ttt import ttt_unroll
from trainer.warm_start import target_lm_rows

VOCAB = 96
ALL_ON = {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}  # speculators' defaults
CASES = [{k: True} for k in HEAD_OPTIONS] + [ALL_ON, {"fc_norm": True, "norm_before_residual": True,
                                                        "norm_output": True}]


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    return T.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval().double()


def head_with(model, seed=1, **options) -> Eagle3Head:
    """A random head whose norms are away from 1, so a norm applied twice, or not at all, shows."""
    torch.manual_seed(seed)
    head = Eagle3Head(head_config_from_target(model.config, VOCAB, **options)).double()
    with torch.no_grad():
        head.fc.weight.mul_(4.0)
        for name, p in head.named_parameters():
            if name.endswith("norm.weight") or ".fc_norm." in name or name.startswith("fc_norm."):
                p.copy_(torch.rand_like(p) + 0.5)
    return head


def ids(seed, n):
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("options", CASES, ids=lambda o: "+".join(o))
def test_ttt_steps_equal_decoder_levels(target, options):
    """Train/inference equivalence with the option on (as tests/test_families.py for EAGLE-3): TTT step s at
    position i == the decoder's chain level s, and the option changes those logits."""
    head = head_with(target, **options)
    gen = EagleGenerator(target, None, head, default_aux_layers(8))
    seq_ids, i, depth = ids(5, 20), 17, 4
    _, aux = gen.target.forward(torch.tensor(seq_ids[: i + 1]), torch.arange(i + 1), gen.target.new_cache())
    gen.draft.reset()
    hid, dlog = gen.draft.ingest(aux, torch.tensor(seq_ids[1: i + 2]), torch.arange(i + 1))
    tree = gen.draft.build_tree(seq_ids[i + 1], hid, dlog, i, 1, depth, depth + 1)
    seq = torch.tensor([seq_ids[: i + 2] + tree.tokens[1:].tolist()])
    cap, _ = capture_hidden(target, seq, None, default_aux_layers(8))
    emb = torch.nn.functional.embedding(seq, target.get_input_embeddings().weight)
    with torch.no_grad():
        steps = [head.logits(x) for x in ttt_unroll(head, cap, emb, depth)]
        plain = Eagle3Head(head_config_from_target(target.config, VOCAB)).double()
        plain.load_state_dict({k: v for k, v in head.state_dict().items() if k in plain.state_dict()})
        plain_steps = [plain.logits(x) for x in ttt_unroll(plain, cap, emb, depth)]
    for s in range(depth):
        torch.testing.assert_close(steps[s][0, i], gen.draft.level_logits[s][0], rtol=1e-4, atol=1e-5)
    changed = (steps[0] - plain_steps[0]).abs().max() if not (options.keys() <= {"norm_output",
                                                                                  "norm_before_residual"}) else 0
    later = (steps[1] - plain_steps[1]).abs().max()
    assert max(float(changed), float(later)) > 1e-3, "the option changed nothing"


@pytest.mark.parametrize("options", [ALL_ON, {"fc_norm": True, "norm_output": True}], ids=["speculators", "fc_norm"])
def test_greedy_identical_to_target(target, options):
    """Lossless with every option: the speculative output is the target's own greedy output."""
    head = head_with(target, **options)
    gen = EagleGenerator(target, None, head, default_aux_layers(8))
    gen.eos = set()
    prompt = ids(7, 30)
    with torch.no_grad():
        want = target.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                               pad_token_id=0, attention_mask=torch.ones(1, 30, dtype=torch.long))[0, 30:].tolist()
    for mode in ("tree", "chain"):
        got = gen.generate(prompt, SpecSettings(mode=mode, top_k=3, depth=4, total_tokens=10, max_new_tokens=24,
                                                sizing="fixed"))  # whole trees every round: some draft lands
        assert got.tokens == want, mode
        assert got.stats.rounds < 24


@pytest.mark.parametrize("options", CASES[-2:], ids=["speculators", "fc_norm"])
def test_speculators_round_trip_and_sglang_refused(tmp_path, target, options):
    head = head_with(target, **options)
    state = head_state(head)
    assert set(state) == set(head_keys(options))
    out = export_head(state, head.config, [1, 3, 4], spec(8), tmp_path / "s", "speculators")
    conf = json.loads((out / "config.json").read_text())
    for k in HEAD_OPTIONS:  # written explicitly: vLLM takes a missing norm_before_residual as true
        assert conf[k] is bool(options.get(k)), k
    back, cfg, aux = import_head(out, 8)
    assert cfg.options == head.config.options and aux == [1, 3, 4]
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    with pytest.raises(ValueError, match="export_formats: sglang: .*speculators"):
        export_head(state, head.config, [1, 3, 4], spec(8), tmp_path / "g", "sglang")


def test_a_peers_checkpoint_imports(tmp_path, target):
    """A speculators-trained head as that trainer writes it: its verifier copies and the embedding ride
    along, and `norm_before_residual` absent means true (vLLM's reading)."""
    head = head_with(target, **ALL_ON)
    out = export_head(head_state(head), head.config, [1, 3, 4], spec(8), tmp_path / "s", "speculators")
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(out / "model.safetensors"))
    tensors["embed_tokens.weight"] = torch.zeros(VOCAB, 64)
    tensors["verifier_norm.weight"] = torch.ones(64)
    save_file(tensors, str(out / "model.safetensors"))
    conf = json.loads((out / "config.json").read_text())
    del conf["norm_before_residual"]
    (out / "config.json").write_text(json.dumps(conf))
    _, cfg, _ = import_head(out, 8)
    assert cfg.options == ALL_ON | {"fc_norm": False}
    conf["fc_norm"] = True  # a config that names tensors the file lacks
    (out / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match=r"missing \['fc_norm.0.weight"):
        import_head(out, 8)


def test_lm_head_from_target_rows(target):
    lm = target.lm_head.weight.detach().float()
    d2t = torch.tensor([3, 3, 10, 20])  # draft ids 0..3 -> target tokens 3, 4, 12, 23
    rows = target_lm_rows(lm, d2t, 64)
    assert torch.equal(rows, lm[[3, 4, 12, 23]])
    with pytest.raises(ValueError, match="lm_head_init"):
        target_lm_rows(lm, d2t, 32)


def test_options_config_errors():
    from trainer.config import Model
    with pytest.raises(ValueError, match="one or the other"):
        Model(norm_before_fc=True, fc_norm=True)
    with pytest.raises(ValueError, match="freeze_lm_head"):
        Model(freeze_lm_head=True)
    with pytest.raises(ValueError, match="loss: lk_hybrid needs labels: soft"):
        Model(kind="dflash", loss="lk_hybrid")  # DFlash's defaults are hard labels with D-PACE
    assert Model(kind="dflash", loss="lk_alpha", labels="soft", position_weight="decay").loss == "lk_alpha"
    with pytest.raises(ValueError, match="rejection_boost: an eagle3 head"):
        Model(kind="dflash", rejection_boost=1.0, labels="soft", position_weight="decay")
    with pytest.raises(ValueError, match="loss_norm: tokens"):
        Model(position_weight="dpace", loss_norm="tokens")
    assert Model(norm_output=True).head_options == {"norm_before_fc": False, "fc_norm": False,
                                                    "norm_before_residual": False, "norm_output": True}


def test_init_std_draws_every_linear_weight(target):
    """model.init_std: a fresh head's linear weights ~ N(0, std^2) (speculators' start), not PyTorch's default."""
    from trainer.config import Model
    from trainer.warm_start import run_head_config, starting_head

    emb = target.get_input_embeddings().weight.detach()
    d2t, t2d = torch.zeros(16, dtype=torch.long), torch.zeros(emb.shape[0], dtype=torch.bool)
    t2d[:16] = True
    stds = {}
    for std in (None, 0.02):
        m = Model(init_std=std)
        head = starting_head(m, run_head_config(m, target.config, 16, emb), d2t, t2d,
                             target.lm_head.weight.detach(), target.config.num_hidden_layers)
        stds[std] = {n: float(p.std()) for n, p in head.named_parameters() if p.dim() == 2 and "embed" not in n}
    assert all(abs(v - 0.02) < 0.003 for v in stds[0.02].values()), stds[0.02]
    assert stds[None]["fc.weight"] != pytest.approx(0.02, abs=0.003)
