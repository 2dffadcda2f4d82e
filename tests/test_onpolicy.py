"""On-policy rounds (`eagleray train` with onpolicy.rounds, infer/onpolicy.py) on the tiny target: fresh
prompts only, the head's own lossless decode as the round's data, shards and a warm-started head, costs
counted, a finished run never redone."""
import json

import pyarrow.parquet as pq
import pytest

from infer.onpolicy import main, prompt_of
from pipeline.shards import read_manifest
from tests.conftest import TEST_THREADS, write_yaml


def test_a_prompt_is_the_request_of_the_first_answer():
    sys_, q1, a1, q2 = ({"role": r, "content": c} for r, c in
                        (("system", "s"), ("user", "q1"), ("assistant", "a1"), ("user", "q2")))
    assert prompt_of([sys_, q1, a1, q2]) == [sys_, q1]
    assert prompt_of([q1]) == [q1]
    assert prompt_of([sys_, a1, q1]) == []  # no question before the first answer: no prompt


def test_trainer_refuses_rounds_it_cannot_decode(tmp_path, pipeline_run, tiny_target):
    from trainer.__main__ import main as trainer_main

    cfg = write_yaml(tmp_path / "t.yaml", {"target": str(tiny_target), "data": {"shards": str(pipeline_run / "capture")},
                                           "onpolicy": {"rounds": 1, "pipeline": str(pipeline_run / "cfg.yaml")}})
    with pytest.raises(SystemExit, match="eagleray train"):
        trainer_main([str(cfg)])


@pytest.fixture(scope="module")
def rounds_run(tmp_path_factory, ray_cluster, pipeline_run, tiny_target):
    out = tmp_path_factory.mktemp("onpolicy") / "run"
    cfg = write_yaml(out.parent / "t.yaml", {
        "target": str(tiny_target), "out_dir": str(out),
        "data": {"shards": str(pipeline_run / "capture"), "max_rows_per_batch": 4, "val_rows": 4},
        "model": {"ttt_length": 3}, "optim": {"lr": 5e-3}, "epochs": 3, "log_every": 20, "export_formats": ["sglang"],
        "scaling": {"num_workers": 1, "cpus_per_worker": 1, "threads_per_worker": TEST_THREADS},
        "onpolicy": {"rounds": 2, "pipeline": str(pipeline_run / "cfg.yaml"), "records_per_round": 12,
                     "max_new_tokens": 24, "threads_per_actor": TEST_THREADS, "epochs": 2}})
    report = main([str(cfg)])
    return out, cfg, report


def test_rounds_decode_fresh_prompts_losslessly_and_count_their_cost(rounds_run, pipeline_run, tiny_target):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _, report = rounds_run
    offline = {json.dumps(prompt_of(json.loads(x)["messages"]))
               for x in (pipeline_run / "ingest" / "records.jsonl").read_text().splitlines()}
    rows = []
    for r in (1, 2):
        t = pq.read_table(out / f"round-{r:03d}" / "decode" / "records.parquet").to_pylist()
        assert len(t) == 12 and all(x["head_version"].startswith("head_sglang@") for x in t)
        rows += t
    prompts = [json.dumps(json.loads(x["messages"])) for x in rows]
    assert len(set(prompts)) == 24 and not set(prompts) & offline  # fresh, and no prompt twice
    tok = AutoTokenizer.from_pretrained(tiny_target)
    model = AutoModelForCausalLM.from_pretrained(tiny_target, torch_dtype=torch.float32)
    for x in rows[:3]:  # the answers are the target's own greedy text
        ids = tok.apply_chat_template(json.loads(x["messages"]), add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]
        ref = model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
        assert x["output_ids"] == ref[:len(x["output_ids"])] and len(x["output_ids"]) >= min(len(ref), 1)
    op = report["onpolicy"]
    for r, rnd in enumerate(op["rounds"], 1):
        dec = rnd["decode"]
        assert dec["records"] == 12 and 1.0 < dec["tau"] <= 4.0  # the head drafts: more than a token a forward
        assert dec["nodes"] == 1  # the one local node (the cluster check sees two)
        assert dec["target_forwards"] == dec["records"] + round(dec["tokens"] / dec["tau"])
        assert rnd["data"]["rows"] == 12 == read_manifest(out / f"round-{r:03d}" / "data" / "capture")["rows"]
    assert op["extra_target_forwards"] == sum(x["decode"]["target_forwards"] + 12 for x in op["rounds"])
    assert (out / "head_sglang" / "config.json").is_file()


def test_each_round_warm_starts_from_the_last_head_on_its_own_served_shards(rounds_run):
    import yaml

    out, _, _ = rounds_run
    state = json.loads((out / "state.json").read_text())
    assert list(state) == ["offline", "prompts", "round-001.decode", "round-001.data", "round-001.train",
                           "round-002.decode", "round-002.data", "round-002.train"]
    heads = [str(out / "offline" / "head_sglang")] + [str(out / f"round-{r:03d}" / "head" / "head_sglang") for r in (1, 2)]
    for r in (1, 2):
        train = state[f"round-{r:03d}.train"]
        assert train["init_from"] == heads[r - 1] and train["head"] == heads[r]
        # a warm start: its first loss is far below a fresh head's on the offline run
        assert train["first_loss"][0] < 0.8 * state["offline"]["first_loss"][0]
        pipe = yaml.safe_load((out / f"round-{r:03d}" / "pipeline.yaml").read_text())
        assert pipe["regenerate"]["enabled"] is False and pipe["ingest"]["sources"][0]["format"] == "served"


def test_a_finished_run_is_not_redone(rounds_run):
    import time

    out, cfg, report = rounds_run
    t0 = time.time()
    again = main([str(cfg)])
    assert again["onpolicy"]["rounds"] == report["onpolicy"]["rounds"] and time.time() - t0 < 30


def test_rounds_start_from_a_given_head_without_an_offline_run(tmp_path, ray_cluster, pipeline_run, tiny_target,
                                                                tiny_head):
    out = tmp_path / "run"
    cfg = write_yaml(tmp_path / "t.yaml", {
        "target": str(tiny_target), "out_dir": str(out), "export_formats": ["sglang"],
        "data": {"shards": str(pipeline_run / "capture"), "max_rows_per_batch": 4, "val_rows": 2},
        "model": {"ttt_length": 3}, "epochs": 1,
        "scaling": {"num_workers": 1, "cpus_per_worker": 1, "threads_per_worker": TEST_THREADS},
        "onpolicy": {"rounds": 1, "pipeline": str(pipeline_run / "cfg.yaml"), "records_per_round": 6,
                     "max_new_tokens": 16, "start_head": str(tiny_head), "threads_per_actor": TEST_THREADS}})
    report = main([str(cfg)])
    state = json.loads((out / "state.json").read_text())
    assert not (out / "offline").exists() and state["offline"]["head"] == str(tiny_head)
    assert state["round-001.train"]["init_from"] == str(tiny_head) and report["steps"] is None
    assert report["onpolicy"]["rounds"][0]["decode"]["records"] == 6 and (out / "head_sglang" / "config.json").is_file()


def test_the_offline_and_a_rounds_capture_join_into_one(rounds_run, pipeline_run, tmp_path):
    import shutil

    from pipeline.shards import join_captures

    out, _, _ = rounds_run
    offline, rnd = pipeline_run / "capture", out / "round-001" / "data" / "capture"
    m = join_captures(offline, rnd, tmp_path / "joined")
    files = sorted((tmp_path / "joined").glob("shard-*.parquet"))
    assert m["rows"] == 64 + 12 == sum(pq.ParquetFile(f).metadata.num_rows for f in files) == read_manifest(tmp_path / "joined")["rows"]
    assert [s["file"] for s in m["shards"]] == [f.name for f in files]
    assert pq.read_table(files[-1]).column("id").to_pylist() == pq.read_table(sorted(rnd.glob("shard-*"))[-1]).column("id").to_pylist()
    assert (tmp_path / "joined" / "draft_vocab.safetensors").read_bytes() == (rnd / "draft_vocab.safetensors").read_bytes()
    other = tmp_path / "other"
    shutil.copytree(rnd, other)
    bad = json.loads((other / "manifest.json").read_text()) | {"hidden_size": 999}
    (other / "manifest.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="hidden_size"):
        join_captures(offline, other, tmp_path / "nope")
