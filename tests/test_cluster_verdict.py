"""`eagleray cluster check` fails unless every job SUCCEEDED and every killed stage's output equals the
undisturbed run's (infer/cluster/check.py `verdict`); the CLI names an unknown fault stage."""
import copy

import pytest

from infer.cluster.check import FAULT_STAGES, verdict
from infer.cluster.cli import main

ROWS = {"rows_expected": 64, "rows_found": 64, "duplicates": 0, "digests_equal": True}
GOOD = {"jobs": {"pipeline": "SUCCEEDED", "trainer": "SUCCEEDED", "eval": "SUCCEEDED", "serve": "SUCCEEDED",
                  "serve_vllm": "SUCCEEDED", "flywheel": "SUCCEEDED", "onpolicy": "SUCCEEDED"},
        "faults": {**{s: {"job": "SUCCEEDED", "killed": True, "running_at_kill": True, **ROWS}
                      for s in FAULT_STAGES[:5] + ("eval",)},
                   "training": {"job": "SUCCEEDED", "killed": True, "resumed_from_step": 20, "steps_logged_twice": 0,
                                "exported": True},
                   "serving": {"job": "SUCCEEDED", "killed": True, "requests_after": 30, "failed_after": 0}},
        "private_disks_asked": True, "isolation": {"private_disks": True},
        "serve_vllm": {"failed": 0, "drafts": 12.0, "same_answers_after_restart": True, "replicas_back": True},
        "flywheel": {"promoted": True, "swapped": True, "replica_nodes": 2, "replicas_on_new_head": 2},
        "onpolicy": {"records": 8, "actor_nodes": 2, "decode_nodes": 1, "rows": 8, "exported": True}}


def broken(path, value):
    res = copy.deepcopy(GOOD)
    *keys, last = path
    node = res
    for k in keys:
        node = node[k]
    node[last] = value
    return res


def test_every_job_succeeded_and_every_output_equal():
    assert verdict(GOOD, list(FAULT_STAGES))
    assert not verdict(broken(("faults", "vocab", "job"), "FAILED"), list(FAULT_STAGES))  # the job, not the rows
    assert not verdict(broken(("jobs", "eval"), "FAILED"), list(FAULT_STAGES))
    assert not verdict(broken(("faults", "capture", "digests_equal"), False), list(FAULT_STAGES))
    assert not verdict(broken(("faults", "tokenize", "duplicates"), 2), list(FAULT_STAGES))
    assert not verdict(broken(("faults", "ingest", "rows_found"), 63), list(FAULT_STAGES))
    assert not verdict(broken(("faults", "regenerate", "killed"), False), list(FAULT_STAGES))  # no kill: no proof
    assert not verdict(broken(("faults", "serving", "failed_after"), 1), list(FAULT_STAGES))
    assert not verdict(broken(("faults", "training", "resumed_from_step"), None), list(FAULT_STAGES))
    without_eval = copy.deepcopy(GOOD)
    del without_eval["faults"]["eval"]
    assert not verdict(without_eval, list(FAULT_STAGES))  # an asked-for fault that never ran
    assert verdict(without_eval, [s for s in FAULT_STAGES if s != "eval"])


def test_a_late_kill_shared_disks_or_a_served_job_short_of_its_goal_fail_the_check():
    assert not verdict(broken(("faults", "vocab", "running_at_kill"), False), list(FAULT_STAGES))  # after it ended
    assert not verdict(broken(("isolation", "private_disks"), False), list(FAULT_STAGES))  # asked, not proved
    assert verdict(broken(("private_disks_asked",), False) | {"isolation": {"private_disks": False}},
                   list(FAULT_STAGES))
    assert not verdict(broken(("serve_vllm", "failed"), 1), list(FAULT_STAGES))
    assert not verdict(broken(("serve_vllm", "drafts"), 0.0), list(FAULT_STAGES))  # the head never drafted
    assert not verdict(broken(("serve_vllm", "same_answers_after_restart"), False), list(FAULT_STAGES))
    assert not verdict(broken(("flywheel", "replicas_on_new_head"), 1), list(FAULT_STAGES))  # one replica behind
    assert not verdict(broken(("flywheel", "replica_nodes"), 1), list(FAULT_STAGES))
    assert not verdict(broken(("flywheel", "promoted"), False), list(FAULT_STAGES))
    assert not verdict(broken(("jobs", "flywheel"), "FAILED"), list(FAULT_STAGES))
    assert not verdict(broken(("onpolicy", "actor_nodes"), 1), list(FAULT_STAGES))  # both actors on one node
    assert not verdict(broken(("onpolicy", "records"), 7), list(FAULT_STAGES))  # a prompt lost
    assert not verdict(broken(("onpolicy", "exported"), False), list(FAULT_STAGES))
    assert not verdict(broken(("jobs", "onpolicy"), "FAILED"), list(FAULT_STAGES))


def test_unknown_fault_stage_is_named(capsys):
    with pytest.raises(SystemExit):
        main(["check", "--fault-stages", "capture,shuffle"])
    assert "unknown ['shuffle']" in capsys.readouterr().err


def test_a_kill_that_missed_its_stage_is_tried_again_in_a_job_of_its_own(tmp_path, monkeypatch):
    """The retry rule of `pipeline_faults`, over a stand-in for the pipeline job: the stages whose kill came
    late go again (and only they), until each lands or the attempts run out."""
    from infer.cluster import check

    late = {"pipeline_fault": {"capture", "vocab"}, "pipeline_fault_2": {"vocab"}, "pipeline_fault_3": set()}
    asked = []

    def fake_job(cl, out, corpus, target, records, base, stages, name):
        asked.append((name, list(stages)))
        (out / f"{name}.log").write_text("Task _Capture.run failed. There are 3 retries remaining\n" * 2)
        return {s: {"job": "SUCCEEDED", "killed": True, "running_at_kill": s not in late[name], **ROWS}
                for s in stages}

    monkeypatch.setattr(check, "pipeline_fault", fake_job)
    monkeypatch.setattr(check, "stage_outputs", lambda run_dir: {})
    result = {"faults": {}, "retried_by_ray": {}}
    check.pipeline_faults(None, tmp_path, "c", "t", 64, list(FAULT_STAGES), result)
    assert asked == [("pipeline_fault", list(FAULT_STAGES[:5])), ("pipeline_fault_2", ["capture", "vocab"]),
                     ("pipeline_fault_3", ["vocab"])]
    assert {s: f["attempts"] for s, f in result["faults"].items()} == {
        "ingest": 1, "regenerate": 1, "tokenize": 1, "capture": 2, "vocab": 3}
    assert all(f["running_at_kill"] for f in result["faults"].values())
    assert result["retried_by_ray"]["pipeline_fault_2"] == {"_Capture": 2}

    late["pipeline_fault_3"] = {"vocab"}  # still late after every attempt: the verdict fails
    asked.clear()
    result = {"faults": {}, "retried_by_ray": {}}
    check.pipeline_faults(None, tmp_path, "c", "t", 64, list(FAULT_STAGES), result, attempts=3)
    assert len(asked) == 3 and result["faults"]["vocab"]["running_at_kill"] is False
