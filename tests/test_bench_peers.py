"""tools/bench/peers.py's data path: our shards in speculators' offline layout, and (where `make peers` built
their environments) speculators' and SpecForge's own trainers on them, their heads read by our engine."""
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tools.bench.peer_envs import speculators_prep
from pipeline.codec import from_bytes
from pipeline.shards import read_manifest
from pipeline.vocab import load_draft_vocab
from pipeline.yaml_config import load_config
from trainer.config import TrainConfig
from trainer.data import collate, shard_files, val_rows

ROOT = Path(__file__).resolve().parents[1]
PEER_PYTHON = ROOT / ".peers" / "speculators" / "bin" / "python"
SPECFORGE_PYTHON = ROOT / ".peers" / "specforge" / "bin" / "python"


def test_shards_to_speculators_layout(tmp_path, pipeline_run, tiny_target):
    capture = pipeline_run / "capture"
    man = read_manifest(capture)
    held = val_rows(shard_files(capture), 5)["id"].to_pylist()
    prep = speculators_prep.write(capture, tiny_target, tmp_path / "prep", 5)
    rows = [json.loads(line) for line in (prep / "rows.jsonl").open()]
    assert len(rows) == man["rows"] == len(list((prep / "hidden_states").glob("hs_*.safetensors")))
    # our training rows first, our held-out rows last: speculators' ratio split gives it exactly those
    tail = [r["input_ids"] for r in speculators_prep.training_rows(capture, 5, held_out=True)]
    assert [r["input_ids"] for r in rows[-5:]] == tail and len(held) == 5
    assert int(len(rows) * speculators_prep.train_ratio(prep)) == man["rows"] - 5
    first = next(speculators_prep.training_rows(capture, 5))
    assert first["id"] not in held
    hs = load_file(str(prep / "hidden_states" / "hs_0.safetensors"))
    h = man["hidden_size"]
    t = len(first["input_ids"])
    assert hs["hidden_states"].shape == (t, 4, h) and hs["token_ids"].tolist() == first["input_ids"]
    assert rows[0] == {"input_ids": first["input_ids"], "loss_mask": first["loss_mask"]}
    aux = from_bytes(first["aux_hidden"], man["dtype"], 3 * h, groups=3).float()
    assert torch.equal(hs["hidden_states"][:, :3].reshape(t, 3 * h), aux)  # exact, in capture order
    # the peer applies the target's final norm to slot 3: that gives back our post-norm state
    w = speculators_prep.final_norm_weight(tiny_target)
    x = hs["hidden_states"][:, 3].double()
    eps = json.loads((tiny_target / "config.json").read_text())["rms_norm_eps"]
    normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()).float()
    last = collate([first], man["dtype"], h)["last"][0].float()
    torch.testing.assert_close(normed, last, rtol=2e-3, atol=2e-3)
    d2t, t2d = load_draft_vocab(capture)
    assert np.array_equal(np.load(prep / "d2t.npy"), d2t.numpy()) and np.array_equal(np.load(prep / "t2d.npy"), t2d.numpy())
    assert speculators_prep.vllm_layer_ids(prep) == [j + 1 for j in man["aux_layer_ids"]]
    assert speculators_prep.write(capture, tiny_target, tmp_path / "prep", 5) == prep  # reused, not rewritten
    # --seed reaches both trainers: ours as seed and data.seed, speculators as its --seed
    from tools.bench import peers as bench_peers
    args = bench_peers.parse(["--target", str(tiny_target), "--capture", str(capture), "--seed", "3"])
    args.ours_cfg = load_config(TrainConfig, args.ours_config, [f"target={tiny_target}", f"data.shards={capture}"])
    for flags in bench_peers.speculators_runs(args, prep, 256).values():
        assert flags[flags.index("--seed") + 1] == "3" and flags[flags.index("--total-seq-len") + 1] == "256"
    # speculators' DFlash follows one DFlash run of ours: its shape, decay, mask token and lr, its own packing
    eagle = bench_peers.speculators_runs(args, prep, 256)["speculators"]
    ours_dflash = {"block_size": 8, "num_layers": 2, "decay_gamma": 4.0, "lr": 5e-3, "mask_token_id": 7,
                   "labels": "soft", "position_weight": "decay", "dpace_alpha": 0.5, "block_causal": False}
    dfl = bench_peers.speculators_dflash_flags(eagle, ours_dflash, 300, 128)
    want = {"--max-anchors": "128", "--speculator-type": "dflash", "--total-seq-len": "300", "--block-size": "8", "--num-layers": "2",
            "--dflash-decay-gamma": "4.0", "--mask-token-id": "7", "--lr": "0.005", "--optimizer": "adamw",
            "--seed": "3", "--target-layer-ids": str(speculators_prep.vllm_layer_ids(prep)[0]),
            "--loss-fn": "kl_div", "--per-position-loss-weight": "fixed-exp-decay"}
    assert {f: dfl[dfl.index(f) + 1] for f in want} == want and all(dfl.count(f) == 1 for f in want)
    assert "--sliding-window-non-causal" in dfl  # our block sees all its slots: so does its
    # speculators' own DFlash recipe (hard labels, D-PACE, a causal block) when ours trains it
    dfl = bench_peers.speculators_dflash_flags(eagle, ours_dflash | {"labels": "hard", "position_weight": "dpace",
                                                                     "dpace_alpha": 0.3, "block_causal": True}, 300, 128)
    want = {"--loss-fn": "ce", "--per-position-loss-weight": "dpace", "--dpace-alpha": "0.3"}
    assert {f: dfl[dfl.index(f) + 1] for f in want} == want and "--no-sliding-window-non-causal" in dfl
    assert eagle[eagle.index("--speculator-type") + 1] == "eagle3"  # the EAGLE-3 run's flags left as they were
    # --prompts held-out: each held-out row's ids up to its first loss token (the prompt the target saw)
    held_rows = list(speculators_prep.training_rows(capture, 5, held_out=True))
    firsts = [r["loss_mask"].index(1) for r in held_rows]
    from tools.bench.peer_judging import held_out_prompts
    assert held_out_prompts(capture, 5) == [r["input_ids"][:f] for r, f in zip(held_rows, firsts)]
    assert all(f > 0 for f in firsts)
    # SpecForge: a row a step, accumulated to our rows per step; aligned to our TTT, decay and lr
    from tools.bench.peer_envs import specforge_bench
    per_row = specforge_bench.rows_per_step({"steps": 10}, prep, 2)
    assert per_row == round((man["rows"] - 5) * 2 / 10)
    runs = specforge_bench.runs(args.ours_cfg, per_row, 2, 3)
    m, o = args.ours_cfg.model, args.ours_cfg.optim
    assert runs["specforge_aligned"] == runs["specforge"] + [
        f"training.ttt_length={m.ttt_length}", f"training.kl_decay={m.decay}", f"training.learning_rate={o.lr}"]
    assert f"training.accumulation_steps={per_row}" in runs["specforge"] and "training.seed=3" in runs["specforge"]


@pytest.mark.slow
@pytest.mark.skipif(not PEER_PYTHON.is_file() and os.environ.get("EAGLERAY_REQUIRE_PEERS") != "1",
                    reason="speculators' environment is not built (`make peers`)")
def test_speculators_trains_on_our_shards_and_we_decode_its_head(tmp_path, pipeline_run, tiny_target):
    """speculators' real trainer (its defaults: EAGLE 3.1 norms, lm_head from the target, TTT 3) on our
    shards for one epoch; its checkpoint imports into our engine with every option it set, and decodes
    losslessly there."""
    from infer.generate import EagleGenerator, SpecSettings
    from trainer.export import import_head

    capture = pipeline_run / "capture"
    prep = speculators_prep.write(capture, tiny_target, tmp_path / "prep", 4)
    save = tmp_path / "spec"
    cmd = [str(PEER_PYTHON), str(ROOT / "tools/bench/peer_envs/speculators_train.py"), str(prep), "--speculator-type", "eagle3",
           "--verifier-name-or-path", str(tiny_target), "--draft-vocab-size", str(speculators_prep.draft_vocab_size(prep)),
           "--d2t-path", str(prep / "d2t.npy"), "--t2d-path", str(prep / "t2d.npy"), "--target-layer-ids",
           *map(str, speculators_prep.vllm_layer_ids(prep)), "--epochs", "1", "--train-data-ratio", str(speculators_prep.train_ratio(prep)),
           "--total-seq-len", "2048", "--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
           "--hidden-states-dtype", "float32", "--num-workers", "0", "--logger", "", "--save-path", str(save)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    head = save / "0"
    _, cfg, aux = import_head(head, 8)
    assert cfg.norm_before_fc and cfg.norm_before_residual and cfg.norm_output  # its defaults, read as vLLM reads them
    assert aux == read_manifest(capture)["aux_layer_ids"]
    gen = EagleGenerator.from_folders(tiny_target, head)
    gen.eos = set()
    ids = gen.tokenizer("hello there, how are you", add_special_tokens=False)["input_ids"]
    plain = EagleGenerator.from_folders(tiny_target, None)
    want = plain.generate(ids, SpecSettings(mode="vanilla", max_new_tokens=24)).tokens
    assert gen.generate(ids, SpecSettings(mode="chain", depth=3, max_new_tokens=24)).tokens[:len(want)] == want


@pytest.mark.slow
@pytest.mark.skipif(not SPECFORGE_PYTHON.is_file() and os.environ.get("EAGLERAY_REQUIRE_PEERS") != "1",
                    reason="SpecForge's environment is not built (`make peers`)")
def test_specforge_trains_on_our_shards_and_we_decode_its_head(tmp_path, pipeline_run, tiny_target):
    """SpecForge's real trainer (0.2.0, on CPU) on our shards for one epoch, exported by its own SGLang
    export; the head names our aux layers as vLLM reads them, imports into our engine, decodes losslessly."""
    from infer.generate import EagleGenerator, SpecSettings
    from trainer.export import import_head

    capture = pipeline_run / "capture"
    prep = speculators_prep.write(capture, tiny_target, tmp_path / "prep", 4)
    save = tmp_path / "sf"
    cmd = [str(SPECFORGE_PYTHON), str(ROOT / "tools/bench/peer_envs/specforge_train.py"), str(prep), str(save),
           str(tiny_target), "training.num_epochs=1", "training.ttt_length=3", "training.learning_rate=3e-3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    head = save / "head"
    assert json.loads((head / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == \
        speculators_prep.vllm_layer_ids(prep)
    _, cfg, aux = import_head(head, 8)
    assert aux == read_manifest(capture)["aux_layer_ids"] and not cfg.norm_before_fc
    assert not (tiny_target / "model.safetensors.index.json").exists()  # the target folder left as it was
    gen = EagleGenerator.from_folders(tiny_target, head)
    gen.eos = set()
    ids = gen.tokenizer("hello there, how are you", add_special_tokens=False)["input_ids"]
    plain = EagleGenerator.from_folders(tiny_target, None)
    want = plain.generate(ids, SpecSettings(mode="vanilla", max_new_tokens=24)).tokens
    assert gen.generate(ids, SpecSettings(mode="chain", depth=3, max_new_tokens=24)).tokens[:len(want)] == want


def test_speculators_loop_seconds_from_its_progress_lines(tmp_path):
    """Training epochs only: each epoch's first 100% line is training, the second its validation."""
    from tools.bench import peers as bench_peers

    log = tmp_path / "s.log"
    log.write_text("Epoch 0 100% ━━━━ 16/16  [ 0:01:06 < 0:00:00 , 3 it/s ]\n"
                   "Epoch 0 100% ━━━━ 2/2  [ 0:00:09 < 0:00:00 , 9 it/s ]\n"
                   "Epoch 1  50% ━━ 8/16  [ 0:00:30 < 0:00:30 , 3 it/s ]\n"
                   "Epoch 1 100% ━━━━ 16/16  [ 1:00:01 < 0:00:00 , 3 it/s ]\n")
    assert bench_peers.speculators_loop_s(log) == 66 + 3601
    log.write_text("no progress lines\n")
    assert bench_peers.speculators_loop_s(log) is None


def test_prompt_sets_split_by_source(tmp_path):
    """--tune-prompts / --report-prompts: named sources interleave (the first n hold each), and two sets that
    share a source or a prompt's text are refused."""
    from infer.benchmarks import disjoint_sets, prompt_set, source_prompts
    from tools.bench.peer_judging import versus_peers

    mt, gsm, ceval = (source_prompts(s) for s in ("mt_bench", "gsm8k", "ceval"))
    assert (len(mt), len(gsm), len(ceval)) == (80, 1319, 371)
    mixed = prompt_set("gsm8k,ceval")
    assert mixed[:4] == [gsm[0], ceval[0], gsm[1], ceval[1]] and len(mixed) == len(set(gsm) | set(ceval))
    tune, report = disjoint_sets("mt_bench", "gsm8k,chat")
    assert len(tune) == 80 and not set(tune) & set(report)
    with pytest.raises(ValueError, match="share gsm8k"):
        disjoint_sets("mt_bench,gsm8k", "gsm8k")
    mine = tmp_path / "mine.jsonl"
    mine.write_text(json.dumps({"prompt": gsm[3]}) + "\n" + json.dumps({"prompt": "something else"}) + "\n")
    with pytest.raises(ValueError, match="share 1 prompts"):
        disjoint_sets("gsm8k", str(mine))
    scores = {"eagleray": {"vllm_tau_k3": 2.2, "vllm_tau_k7": 2.4, "accept_by_pos_k3": [0.6, 0.3]},
              "spec": {"vllm_tau_k3": 2.0, "vllm_tau_k7": 2.5, "accept_by_pos_k3": [0.5, 0.3]},
              "ours_lk": {"vllm_tau_k3": 9.0}}
    kinds = {"eagleray": "eagleray", "spec": "speculators", "ours_lk": "eagleray"}
    assert versus_peers(kinds, scores) == {
        "eagleray_vs_best_peer": 1.1, "eagleray_vs_best_peer_k7": 0.96, "eagleray_vs_best_peer_pos1": 1.2}
