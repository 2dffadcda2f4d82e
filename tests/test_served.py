"""Served records: the traffic log's writer, its format as a corpus, and the warm start's replay rules."""
import json

import pyarrow.parquet as pq
import pytest

from infer.traffic_log import TrafficLog, TrafficLogConfig
from pipeline.formats import Reject, normalise
from pipeline.served import rejections, served_row, time_split


def row(i: int, question: str = "What is 2 + 2?", answer: str = "4", route: str = "chat") -> dict:
    return served_row(request_id=f"r{i}", model="m", route=route, messages=[{"role": "user", "content": question}],
                      prompt_tokens=5, output_ids=[1, 2, 3], output_text=answer, finish_reason="eos",
                      temperature=0.0, depth=4, accepted=[2, 4, 0], round_starts=[1, 4, 9], tau=2.5,
                      head_version="head@abc", started_at=100.0 + i, finished_at=101.0 + i)


def test_log_writes_every_row_in_batches(tmp_path):
    log = TrafficLog(TrafficLogConfig(path=tmp_path, flush_rows=4, flush_s=60))
    for i in range(10):
        log.record(row(i))
    log.close()
    files = sorted(tmp_path.glob("traffic-*.parquet"))
    rows = [r for f in files for r in pq.read_table(f).to_pylist()]
    assert len(files) == 3 and [r["request_id"] for r in rows] == [f"r{i}" for i in range(10)]
    assert rows[0]["accepted"] == [2, 4, 0] and rows[0]["head_version"] == "head@abc"
    assert log.stats()["logged"] == 10 and log.stats()["bytes"] == sum(f.stat().st_size for f in files)


def test_log_counts_what_it_does_not_keep(tmp_path):
    sampled = TrafficLog(TrafficLogConfig(path=tmp_path / "s", sample_rate=0.5), seed=0)
    for i in range(200):
        sampled.record(row(i))
    sampled.close()
    st = sampled.stats()
    assert st["logged"] + st["not_sampled"] == 200 and 60 < st["logged"] < 140
    capped = TrafficLog(TrafficLogConfig(path=tmp_path / "c", max_mb=1e-6, flush_rows=1))
    for i in range(5):
        capped.record(row(i))
    capped.close()
    st = capped.stats()
    assert st["logged"] >= 1 and st["logged"] + st["dropped_over_cap"] == 5
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    broken = TrafficLog(TrafficLogConfig(path=blocked, flush_rows=2))
    for i in range(4):
        broken.record(row(i))  # never raises into the request
    broken.close()
    assert broken.stats()["dropped_write_failed"] == 4 and broken.stats()["logged"] == 0


def test_served_rows_normalise_to_the_conversation_answered():
    assert normalise(row(0)) == [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]
    with pytest.raises(Reject, match="completions request"):
        normalise(row(0, route="completion"))
    with pytest.raises(Reject, match="empty answer"):
        normalise(row(0, answer=" "))
    assert rejections([2, 4, 0], [1, 4, 9], 4) == [3, 9]  # round 2 accepted all 4 drafted tokens


def test_time_split_holds_out_the_latest():
    rows = [{"id": f"r{i}", "finished_at": float(t)} for i, t in enumerate([5, 1, 4, 2, 3])]
    train, held = time_split(rows, 0.4)
    assert [r["finished_at"] for r in train] == [1, 2, 3] and [r["finished_at"] for r in held] == [4, 5]
    assert time_split(rows, 0.0) == (sorted(rows, key=lambda r: r["finished_at"]), [])
    with pytest.raises(ValueError, match="held_out"):
        time_split(rows, 1.0)


def test_regenerate_passes_served_records_through(tmp_path):
    from pipeline.regenerate import split_served

    recs = tmp_path / "records.jsonl"
    lines = [{"id": "a", "source": "s", "messages": []}, {"id": "b", "source": "t", "messages": [], "served": True}]
    recs.write_text("".join(json.dumps(x) + "\n" for x in lines))
    (tmp_path / "out").mkdir()
    rest, served = split_served(recs, tmp_path / "out")
    assert [json.loads(x)["id"] for x in rest.read_text().splitlines()] == ["a"]
    assert [json.loads(x) for x in served] == [lines[1] | {"regenerated": False}]
    recs.write_text(json.dumps(lines[0]) + "\n")
    assert split_served(recs, tmp_path / "out") == (recs, [])


def manifest(rows_per_shard: list[int], **sig) -> dict:
    base = {"target_config_sha256": "c", "target_weights_id": "w", "hidden_size": 64, "num_layers": 4,
            "aux_layer_ids": [0, 1, 2], "dtype": "bf16", "max_length": 512, "chat_template_sha256": "t",
            "vocab_size": 100}
    return base | sig | {"shards": [{"file": f"shard-{i:05d}.parquet", "rows": n, "tokens": 10 * n}
                                    for i, n in enumerate(rows_per_shard)]}


def test_replay_takes_whole_shards_spread_over_the_old_capture():
    from trainer.sources import replay_shards

    old, new = manifest([100] * 10), manifest([50, 50], max_length=256)  # another max_length is fine
    picked = replay_shards(old, new, 100, 0.5)  # 100 new rows, half the mix replayed: 100 old rows
    assert [s["file"] for s in picked] == ["shard-00000.parquet"]
    picked = replay_shards(old, new, 300, 0.5)
    assert [s["file"] for s in picked] == ["shard-00000.parquet", "shard-00003.parquet", "shard-00007.parquet"]
    assert replay_shards(old, new, 100, 0.0) == []
    with pytest.raises(ValueError, match="data.replay.shards: aux_layer_ids"):
        replay_shards(manifest([100], aux_layer_ids=[1, 2, 3]), new, 100, 0.5)
    with pytest.raises(ValueError, match="data.replay.shards: dtype"):
        replay_shards(manifest([100], dtype="fp8"), new, 100, 0.5)


@pytest.mark.slow
def test_warm_start_refuses_a_head_of_other_layers(tiny_head, tiny_target):
    from pipeline.target import TargetSpec
    from trainer.export import import_head
    from trainer.warm_start import check_init_from

    spec = TargetSpec.read(tiny_target)
    _, _, aux = import_head(tiny_head, spec.num_layers)
    check_init_from(tiny_head, {"aux_layer_ids": aux, "hidden_size": spec.hidden_size}, spec)  # its own: fine
    other = [a + 1 for a in aux]
    with pytest.raises(ValueError, match=rf"model.init_from: .* reads aux layers \[{aux[0]}.*the shards hold \[{other[0]}"):
        check_init_from(tiny_head, {"aux_layer_ids": other, "hidden_size": spec.hidden_size}, spec)
    with pytest.raises(ValueError, match="model.init_from: .* hidden states"):
        check_init_from(tiny_head, {"aux_layer_ids": aux, "hidden_size": spec.hidden_size + 8}, spec)
