"""Trainer on Ray Train + DeepSpeed (2 CPU workers): ZeRO 1/2/3, exact resume, NaN stop, manifest checks."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import write_yaml
from pipeline.yaml_config import load_config
from trainer.config import TrainConfig

pytestmark = pytest.mark.slow


def train_cfg(tmp_path: Path, pipeline_run: Path, tiny_target: Path, **over) -> TrainConfig:
    tree = {"target": str(tiny_target), "out_dir": str(tmp_path / "out"),
            "data": {"shards": str(pipeline_run / "capture"), "max_tokens_per_batch": 1024,
                     "max_rows_per_batch": 4, "bucket_pool": 32, "val_rows": 8},
            "model": {"ttt_length": 3},
            "optim": {"lr": 3e-3, "warmup_ratio": 0.1},
            "scaling": {"num_workers": 2, "cpus_per_worker": 0.5, "threads_per_worker": 1},
            "deepspeed": {"zero_stage": 2}, "max_steps": 6, "checkpoint_every": 3, "eval_every": 3, "log_every": 1}
    overrides = [f"{k}={v}" for k, v in over.items()]
    tmp_path.mkdir(parents=True, exist_ok=True)
    return load_config(TrainConfig, write_yaml(tmp_path / "train.yaml", tree), overrides)


def train_losses(out: Path) -> list[list[float]]:
    return [h["loss"] for h in json.loads((out / "history.json").read_text()) if "loss" in h]


@pytest.mark.parametrize("stage,dtype", [(1, "fp32"), (3, "fp32"), (2, "bf16")])
def test_zero_stages_train_on_two_workers(stage, dtype, tmp_path, ray_cluster, pipeline_run, tiny_target):
    """bf16 also runs the loop's check that the head's RoPE inv_freq stayed fp32 under DeepSpeed; ZeRO-1 runs
    the compiled objective (model.compile); ZeRO-3 runs DeepSpeed's Muon (optim.name: muon)."""
    from trainer.driver import run_training

    report = run_training(train_cfg(tmp_path, pipeline_run, tiny_target, max_steps=10, epochs=5,
                                    **{"deepspeed.zero_stage": stage, "deepspeed.dtype": dtype, "optim.lr": 5e-3,
                                       "data.bucket_pool": 8,
                                       "model.compile": stage == 1,  # the compiled step inside Ray + DeepSpeed
                                       "optim.name": "muon" if stage == 3 else "adamw", "optim.muon_lr": 0.3}))
    assert len(train_losses(tmp_path / "out")) == 10
    evals = [h for h in json.loads((tmp_path / "out/history.json").read_text()) if "val_loss" in h]
    assert [e["step"] for e in evals] == [0, 3, 6, 9, 10]
    assert evals[-1]["val_loss"][0] < 0.9 * evals[0]["val_loss"][0]  # held-out step-0 loss falls
    for fmt in ("sglang", "speculators"):
        tensors = load_file(str(tmp_path / "out" / f"head_{fmt}" / "model.safetensors"))
        assert len(tensors) == 15 and all(torch.isfinite(v.float()).all() for v in tensors.values())
    taus = [e["sim_tau"] for e in evals]  # the best is the highest held-out tau, above the untrained head's
    assert report["best"]["sim_tau"] == max(taus) > taus[0]


def test_resume_is_exact(tmp_path, ray_cluster, pipeline_run, tiny_target):
    from trainer.driver import run_training

    one = dict(**{"scaling.num_workers": 1, "scaling.cpus_per_worker": 1, "max_steps": 10, "epochs": 3,
                  "checkpoint_every": 5, "eval_every": 100, "data.max_tokens_per_batch": 4096,
                  "data.max_rows_per_batch": 8})  # ~7 steps an epoch: the resumed run crosses an epoch end
    run_training(train_cfg(tmp_path / "a", pipeline_run, tiny_target, **one))
    straight = train_losses(tmp_path / "a/out")
    run_training(train_cfg(tmp_path / "b", pipeline_run, tiny_target, run_steps=5, **one))
    assert len(train_losses(tmp_path / "b/out")) == 5
    run_training(train_cfg(tmp_path / "b", pipeline_run, tiny_target, **one))  # resumes at step 5
    resumed = train_losses(tmp_path / "b/out")
    assert len(straight) == len(resumed) == 10
    marks = "".join("L" if "loss" in h else "E" for h in json.loads((tmp_path / "b/out/history.json").read_text())
                    if "loss" in h or "epoch_end" in h)
    assert "E" in marks[marks.index("L" * 5) + 5:-1], marks  # an epoch ended inside the resumed half
    assert max(abs(x - y) for a, b in zip(straight, resumed) for x, y in zip(a, b)) <= 1e-6


def test_nan_stops_and_keeps_last_good_checkpoint(tmp_path, ray_cluster, pipeline_run, tiny_target):
    from trainer.driver import latest_checkpoint, run_training

    cfg = train_cfg(tmp_path, pipeline_run, tiny_target, **{"optim.lr": 1e20, "optim.warmup_ratio": 0.0,
                                                             "checkpoint_every": 1, "eval_every": 100})
    with pytest.raises(Exception, match="non-finite loss at step"):
        run_training(cfg)
    ck = latest_checkpoint(tmp_path / "out")
    assert ck is not None
    state = json.loads((Path(ck[1]) / "trainer_state.json").read_text())
    assert state["global_step"] == ck[0] >= 1
    assert all(all(torch.isfinite(torch.tensor(x)).all() for x in h["loss"]) for h in state["history"] if "loss" in h)


def test_shards_from_another_target_are_refused(tmp_path, pipeline_run, tiny_target):
    from pipeline.shards import read_manifest
    from pipeline.target import TargetSpec
    from test_pipeline_capture import make_random_target
    from trainer.data import check_manifest

    other = make_random_target("qwen3", tiny_target, tmp_path / "other")
    man = read_manifest(pipeline_run / "capture")
    with pytest.raises(ValueError, match="manifest field target_config_sha256"):
        check_manifest(man, TargetSpec.read(other))
    bad = dict(man, hidden_size=128)
    with pytest.raises(ValueError, match="manifest field hidden_size is 128"):
        check_manifest(bad, TargetSpec.read(tiny_target))


def test_held_out_rows_that_leave_none_to_train_on_are_refused(pipeline_run):
    """A round of 8 records under `val_rows: 8` trained zero steps and failed looking for a head it never
    wrote (a cluster check's on-policy round): now refused before any work, naming the key."""
    from pipeline.shards import read_manifest
    from trainer.sources import check_training_rows, parquet_data

    rows = read_manifest(pipeline_run / "capture")["rows"]
    with pytest.raises(ValueError, match=f"data.val_rows: {rows} held-out rows of {rows} leave none to train on"):
        parquet_data(pipeline_run / "capture", rows)
    check_training_rows(rows, rows - 1)  # one row left to train on passes


def test_two_workers_trade_rows_and_replay_the_cached_epoch(tmp_path, ray_cluster, pipeline_run, tiny_target):
    """2 workers, 2 epochs: with rows moved between the ranks at every pool (the pools planned together),
    each epoch still trains every row once (row count and id-hash tally over both ranks), and the second
    epoch, replayed from the workers' memory, trains to the same losses as a run that streams it again
    (data.cache_mb=0)."""
    import pyarrow.parquet as pq

    from trainer.data import shard_files
    from trainer.driver import run_training
    from trainer.data import id_hash

    over = {"epochs": 2, "max_steps": 1000, "eval_every": 1000, "checkpoint_every": 1000,
            "data.max_tokens_per_batch": 512}
    report = run_training(train_cfg(tmp_path / "cached", pipeline_run, tiny_target, **over))
    run_training(train_cfg(tmp_path / "streamed", pipeline_run, tiny_target, **over, **{"data.cache_mb": 0}))
    # each epoch's training seconds (reading and steps, no evaluation or checkpoint), summed in the report
    assert len(report["epoch_train_s"]) == 2 and all(s > 0 for s in report["epoch_train_s"]), report
    assert report["train_loop_s"] == pytest.approx(sum(report["epoch_train_s"]), abs=0.1)
    assert report["train_loop_s"] < report["wall_s"]
    ids = [i for f in shard_files(pipeline_run / "capture") for i in pq.read_table(f, columns=["id"])["id"].to_pylist()]
    ids = ids[:len(ids) - 8]  # val_rows
    for run in ("cached", "streamed"):
        hist = json.loads((tmp_path / run / "out/history.json").read_text())
        ends = [h for h in hist if "epoch_end" in h]
        assert [e["epoch_end"] for e in ends] == [0, 1], ends
        if len(ids) % 2 == 0:  # Ray Data's equal split drops an odd last row
            assert all((e["rows"], e["ids_hash"]) == (len(ids), sum(map(id_hash, ids))) for e in ends), ends
        else:
            assert ends[0]["rows"] == ends[1]["rows"] == len(ids) - 1 and ends[0]["ids_hash"] == ends[1]["ids_hash"]
    cached, streamed = train_losses(tmp_path / "cached/out"), train_losses(tmp_path / "streamed/out")
    assert len(cached) == len(streamed) > 6
    assert max(abs(a - b) for x, y in zip(cached, streamed) for a, b in zip(x, y)) <= 1e-6


def test_lr_schedules_warm_up_then_decay_to_the_floor():
    """optim.schedule: both shapes warm up alike and end at min_lr_ratio; linear sits below cosine before the
    middle of the decay and above it after (cosine is flat at both ends)."""
    from trainer.loop import lr_lambda

    cos, lin = lr_lambda(110, 0.1, 0.1), lr_lambda(110, 0.1, 0.1, "linear")
    assert [cos(s) for s in range(11)] == [lin(s) for s in range(11)] == pytest.approx([(s + 1) / 11 for s in range(11)])
    assert cos(110) == pytest.approx(0.1) and lin(110) == pytest.approx(0.1)
    assert lin(44) == pytest.approx(0.1 + 0.9 * 2 / 3) and lin(44) < cos(44)  # 11 warm-up steps, 99 of decay
    assert lin(77) == pytest.approx(0.1 + 0.9 / 3) and lin(77) > cos(77)
    assert TrainConfig.model_fields["optim"].annotation(schedule="linear").schedule == "linear"
