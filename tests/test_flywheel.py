"""The flywheel's own rules: the gate's decision, held-out prompts, rounds that resume, traffic it waits for.
The whole loop against a live endpoint runs in tests/test_serve.py."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from infer.flywheel import Round, Waiting, derived_yaml, step_log
from infer.gate import HELD_OUT, decide, held_out_items
from pipeline.served import SERVED_SCHEMA, served_row


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
