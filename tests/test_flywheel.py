"""The flywheel's own rules: the gate's decision, held-out prompts, rounds that resume, traffic it waits for.
The whole loop against a live endpoint runs in tests/test_serve.py."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from infer.flywheel import (FlywheelConfig, Round, Waiting, check_shared_locations, derived_yaml, run_round, step_gate,
                            step_log, step_pipeline, step_report, step_swap, step_train)
from infer.gate import HELD_OUT, decide, held_out_items
from pipeline import storage
from pipeline.served import SERVED_SCHEMA, served_row


@pytest.fixture(scope="module")
def s3():
    from infer.cluster.local import S3Server

    with S3Server() as server:
        yield server


def rec(name, serving, candidate, match=True):
    """A gate record: (tokens, rounds) of each head on one prompt."""
    return {"set": name, "id": "x", "serving": {"tokens": serving[0], "rounds": serving[1], "match": True},
            "candidate": {"tokens": candidate[0], "rounds": candidate[1], "match": match}}


def test_gate_promotes_only_on_a_traffic_gain_with_no_benchmark_fall_and_identical_output():
    gain = [rec(HELD_OUT, (60, 30), (60, 24)), rec(HELD_OUT, (40, 20), (40, 16))]  # tau 2.0 -> 2.5
    kept = [rec("mt_bench", (64, 20), (64, 20))]  # 3.2 -> 3.2
    d = decide(gain + kept, min_gain=1.2, max_drop=0.02)
    assert d["promote"] and d["reasons"] == [] and d["sets"][HELD_OUT]["ratio"] == 1.25
    assert d["sets"][HELD_OUT]["serving_tau"] == 2.0 and d["sets"][HELD_OUT]["prompts"] == 2
    assert not decide(gain + kept, min_gain=1.3, max_drop=0.02)["promote"]  # 1.25x short of 1.3x
    fell = decide(gain + [rec("mt_bench", (64, 20), (64, 21))], 1.2, 0.02)  # 3.2 -> 3.05: -4.8%
    assert not fell["promote"] and fell["reasons"][0].startswith("mt_bench: tau 3.048 vs 3.200")
    assert decide(gain + [rec("mt_bench", (64, 20), (64, 21))], 1.2, 0.05)["promote"]
    lossy = decide([rec(HELD_OUT, (60, 30), (60, 20), match=False)] + kept, 1.2, 0.02)
    assert not lossy["promote"] and not lossy["identical"] and "differs" in lossy["reasons"][0]


def test_held_out_prompts_end_before_the_answer(tmp_path):
    f = tmp_path / "held_out.jsonl"
    rows = [{"id": "a", "messages": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
                                     {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]},
            {"id": "b", "messages": [{"role": "assistant", "content": "orphan"}]}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    items = held_out_items(f, None)
    assert [it["id"] for it in items] == ["a"]  # a record with no question is no prompt
    assert [m["content"] for m in items[0]["messages"]] == ["q1", "a1", "q2"]


def traffic_file(path, n, t0=1000.0):
    rows = [served_row(request_id=f"r{i}", model="m", route="chat", messages=[{"role": "user", "content": f"q{i}"}],
                       prompt_tokens=3, output_ids=[1, 2], output_text="ok", finish_reason="stop", temperature=0.0,
                       depth=4, accepted=[1], round_starts=[1], tau=1.5, head_version="h@0", started_at=t0 + i,
                       finished_at=t0 + i + 1) for i in range(n)]
    pq.write_table(pa.Table.from_pylist(rows, SERVED_SCHEMA), path)


class Cfg:  # the two keys step_log reads
    def __init__(self, min_records):
        self.min_records = min_records


def test_rounds_take_only_new_traffic_wait_for_enough_and_resume(tmp_path):
    traffic, work = tmp_path / "traffic", tmp_path / "work"
    traffic.mkdir()
    traffic_file(traffic / "traffic-a-000000.parquet", 5)
    now = {"traffic": str(traffic), "head": "h", "head_version": "h@0"}
    with pytest.raises(Waiting, match="5 new served records .* needs 8"):
        Round(work).run("log", step_log, Cfg(8), now)
    r1 = Round(work)
    assert r1.dir.name == "round-001" and r1.state["steps"] == {}  # waiting wrote no step
    got = r1.run("log", step_log, Cfg(4), now)
    assert got["records"] == 5 and len(list((r1.dir / "traffic").glob("*.parquet"))) == 1
    calls = []
    r1.run("pipeline", lambda r: calls.append(1) or {"records": 5})
    again = Round(work)  # cut short after pipeline: the same round, its steps kept
    assert again.dir == r1.dir
    assert again.run("pipeline", lambda r: calls.append(2) or {})["records"] == 5
    assert calls == [1] and set(again.state["steps"]) == {"log", "pipeline"}
    again.run("report", lambda r: {})
    r2 = Round(work)  # the round ended: the next one, and the first one's file is not new traffic
    assert r2.dir.name == "round-002"
    with pytest.raises(Waiting, match="^0 new served records"):
        r2.run("log", step_log, Cfg(1), now)
    traffic_file(traffic / "traffic-a-000001.parquet", 3)
    assert r2.run("log", step_log, Cfg(3), now)["records"] == 3


def test_round_configs_are_the_base_with_the_rounds_keys(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"target": "t", "data": {"shards": "old", "val_rows": 48}, "epochs": 5}))
    out = derived_yaml(base, tmp_path / "round.yaml", {"data.shards": "new", "model.init_from": "h", "epochs": 2})
    assert yaml.safe_load(out.read_text()) == {"target": "t", "data": {"shards": "new", "val_rows": 48}, "epochs": 2,
                                               "model": {"init_from": "h"}}


def test_rounds_over_an_s3_work_dir_find_their_state_take_traffic_once_and_append_the_report(tmp_path, s3):
    traffic, work = tmp_path / "traffic", s3.uri(f"eagleray/fly/{tmp_path.name}")
    traffic.mkdir()
    traffic_file(traffic / "traffic-a-000000.parquet", 5)
    now = {"traffic": str(traffic), "head": "h", "head_version": "h@0"}
    rest = {"gate": {"sets": {HELD_OUT: {"serving_tau": 2.0, "candidate_tau": 2.5}}}, "swap": {"head_version": "h@1"}}
    for n, records in ((1, 5), (2, 3)):
        rnd = Round(work)
        assert rnd.dir == storage.join(work, f"round-{n:03d}")
        assert rnd.run("log", step_log, Cfg(1), now)["records"] == records
        assert storage.list_names(storage.join(rnd.dir, "traffic")) == [f"00000-traffic-a-00000{n - 1}.parquet"]
        for name, out in rest.items():
            rnd.run(name, lambda r, o=out: o)
        rnd.run("report", step_report, None)
        step_report(rnd, None)  # a report step cut short after its write, run again: no second line
        # a state.json deeper in the round is none of the rounds' (a URI's * spans folders)
        storage.write_text(storage.join(rnd.dir, "head", "state.json"), '{"steps": {}}')
        traffic_file(traffic / "traffic-a-000001.parquet", 3)
    assert json.loads(storage.read_text(storage.join(work, "round-002", "state.json")))["steps"]["log"]["files"] == [
        str(traffic / "traffic-a-000001.parquet")]
    assert storage.name(Round(work).dir) == "round-003"  # both rounds found, both ended
    report = storage.read_text(storage.join(work, "report.md"))
    assert report.startswith("# Flywheel rounds") and [report.count(f"\n| {n} | ") for n in (1, 2)] == [1, 1]
    assert "traffic 2.00 -> 2.50 | h@1 |" in report


def fly_config(tmp_path, work_dir, replay: str) -> FlywheelConfig:
    target = tmp_path / "target"
    target.mkdir(exist_ok=True)
    pipe, train = tmp_path / "pipeline.yaml", tmp_path / "trainer.yaml"
    pipe.write_text(yaml.safe_dump({"target": str(target)}))
    train.write_text(yaml.safe_dump({"target": str(target), "data": {"shards": "unused", "val_rows": 0}}))
    return FlywheelConfig.model_validate({"endpoint": "http://127.0.0.1:9", "work_dir": work_dir, "pipeline": pipe,
                                          "trainer": train, "replay": {"shards": replay}})


def test_a_round_under_an_s3_work_dir_names_every_folder_head_and_shard_by_uri(tmp_path, s3, monkeypatch):
    """The round's pipeline, trainer and gate configs (loaded as the stages would be) and the swap's POST name
    URIs under the round, so workers and replicas on any node read them; the YAMLs are kept in the round."""
    import infer.flywheel as flywheel
    import infer.gate as gate
    import pipeline.__main__ as pipeline_main
    import trainer.driver as driver

    monkeypatch.setenv("EAGLERAY_CACHE", str(tmp_path / "cache"))
    root = f"eagleray/{tmp_path.name}"
    replay, tokens, head = (s3.uri(f"{root}/{p}") for p in ("old/capture", "old/tokenize/tokens.parquet", "head"))
    storage.write_text(tokens, "parquet")
    cfg = fly_config(tmp_path, s3.uri(f"{root}/fly"), replay)
    rnd = Round(cfg.work_dir)
    rnd.state["steps"]["log"] = {"head": head, "seconds": 0}
    seen, at = {}, lambda *names: storage.join(rnd.dir, *names)  # noqa: E731
    monkeypatch.setattr(pipeline_main, "run", lambda c: seen.update(pipeline=c) or {
        "ingest": {"records": 4, "held_out": 1, "rejected_by_reason": {}}, "capture": {"rows": 9}})
    monkeypatch.setattr(driver, "run_training", lambda c: seen.update(train=c) or {"loss": 1.0})
    monkeypatch.setattr(gate, "run_gate", lambda c: seen.update(gate=c) or {
        "sets": {}, "identical": True, "promote": True, "reasons": []})
    monkeypatch.setattr(flywheel, "endpoint_call", lambda c, path, body: seen.update(swap=body) or (200, {}))
    rnd.run("pipeline", step_pipeline, cfg)
    p = seen["pipeline"]
    assert (p.run_dir, p.ingest.sources[0].path, p.vocab.include) == (at("data"), at("traffic", "*.parquet"), [tokens])
    assert yaml.safe_load(storage.read_text(at("pipeline.yaml")))["run_dir"] == at("data")
    candidate = rnd.run("train", step_train, cfg)["candidate"]
    t = seen["train"]
    assert (t.out_dir, t.data.shards, t.data.replay.shards, t.model.init_from) == (at("head"), at("data", "capture"),
                                                                                  replay, head)
    assert candidate == at("head", f"head_{t.export_formats[0]}") and storage.is_file(at("trainer.yaml"))
    storage.Mirror(at("pipeline.yaml")).local.unlink()  # the gate reads the round's YAML from the store
    rnd.run("gate", step_gate, cfg)
    g = seen["gate"]
    assert (g.serving, g.candidate, g.held_out, g.out_dir) == (head, candidate, at("data", "ingest", "held_out.jsonl"),
                                                               rnd.dir)
    assert rnd.run("swap", step_swap, cfg)["swapped"] and seen["swap"] == {"head": candidate}


def test_a_local_work_dir_is_refused_on_a_cluster_of_several_nodes_before_any_work(tmp_path, monkeypatch):
    import pipeline.cluster as cluster

    def no_ray(address=None):
        raise AssertionError("no cluster named: Ray is not started to count nodes")

    monkeypatch.delenv("EAGLERAY_SHARED_PATHS", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(cluster, "ensure_ray", no_ray)
    local = fly_config(tmp_path, tmp_path / "fly", "s3://eagleray/old/capture")
    check_shared_locations(local)  # a local Ray: one node
    joined = []
    monkeypatch.setattr(cluster, "ensure_ray", lambda address=None: joined.append(address) or f"joined {address}")
    monkeypatch.setattr(cluster, "node_count", lambda: 3)
    with pytest.raises(storage.StorageError, match="^work_dir: "):  # the cluster the round's pipeline joins
        check_shared_locations(local.model_copy(update={"pipeline_overrides": ["ray_address=10.0.0.2:6379"]}))
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    with pytest.raises(storage.StorageError) as e:
        run_round(local)  # refused before the endpoint is asked or a round folder made
    assert joined == ["10.0.0.2:6379", "10.0.0.1:6379"]
    assert str(e.value).startswith(f"work_dir: {tmp_path / 'fly'} is a local path") and "3 nodes" in str(e.value)
    assert "\n" not in str(e.value) and not (tmp_path / "fly").exists()
    check_shared_locations(local.model_copy(update={"work_dir": "s3://eagleray/fly"}))  # every location a URI
