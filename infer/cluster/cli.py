"""eagleray cluster up|down|check: a local multi-node Ray cluster (infer/cluster/local.py) and its check.

    eagleray cluster up                     # head + 2 workers; prints the addresses; stays up (state file)
    eagleray cluster down                   # stops what `up` started, by pid
    eagleray cluster check                  # up, every stage by `ray job submit`, a node lost in each; JSON last
    eagleray cluster check --fault-stages capture,vocab --head-kill   # only those faults; and a lost head
    eagleray cluster check --throughput     # and tokens/s on one worker node against two
    eagleray cluster up --private-disks     # each worker node with disks of its own (check: on by default)
    eagleray cluster check --no-vllm --no-flywheel --no-onpolicy   # leave out the vllm backend and the rounds
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from infer.cluster.check import FAULT_STAGES, run_check
from infer.cluster.local import ROOT, LocalCluster, stop_processes

STATE = ROOT / "runs" / "cluster" / "cluster.json"


def up(args) -> dict:
    cluster = LocalCluster(Path(args.dir), workers=args.workers, private_disks=args.private_disks).start()
    state = {"root": str(cluster.root), "address": cluster.address, "dashboard": cluster.dashboard,
             "nodes": [n.name for n in cluster.nodes]}
    STATE.parent.mkdir(parents=True, exist_ok=True)
    STATE.write_text(json.dumps(state, indent=2))
    return state


def down(args) -> dict:
    state = json.loads(STATE.read_text()) if STATE.is_file() else {"root": args.dir}
    stopped = stop_processes((str(Path(state["root"])) + "/",
                              *([f"--address={state['address']}"] if state.get("address") else [])))
    STATE.unlink(missing_ok=True)
    return {"stopped_processes": len(stopped)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="eagleray cluster", description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=("up", "down", "check"))
    ap.add_argument("--dir", default="/tmp/eagleray-cluster",
                    help="the nodes' temp dirs (short: Ray's socket paths live under it)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "cluster" / "check")
    ap.add_argument("--throughput", action="store_true",
                    help="check: also capture and training tokens/s on one worker node against two (~10 min)")
    ap.add_argument("--fault-stages", default=",".join(FAULT_STAGES),
                    help="check: the stages to kill a worker node in, one kill each (comma-separated; '' for none)")
    ap.add_argument("--head-kill", action="store_true",
                    help="check: also kill the head mid-capture, start the cluster again and resubmit (~3 min)")
    ap.add_argument("--private-disks", action=argparse.BooleanOptionalAction, default=None,
                    help="each worker node in a mount namespace of its own: empty /tmp, $HOME, caches and "
                         "--dir, the code read-only, as a real cluster's nodes (default: on for check, off for up)")
    ap.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=True,
                    help="check: serve the head on the vllm backend too, a worker killed under it (~4 min)")
    ap.add_argument("--flywheel", action=argparse.BooleanOptionalAction, default=True,
                    help="check: one flywheel round against the served endpoint, its swap on both replicas (~5 min)")
    ap.add_argument("--onpolicy", action=argparse.BooleanOptionalAction, default=True,
                    help="check: one on-policy training round, its decode on both worker nodes (~3 min)")
    args = ap.parse_args(argv)
    if args.private_disks is None:
        args.private_disks = args.action == "check"
    unknown = set(filter(None, args.fault_stages.split(","))) - set(FAULT_STAGES)
    if unknown:
        ap.error(f"--fault-stages: unknown {sorted(unknown)}; choose from {','.join(FAULT_STAGES)}")
    result = {"up": up, "down": down, "check": run_check}[args.action](args)
    print(json.dumps(result))
    if args.action == "check" and not result["ok"]:
        raise SystemExit("cluster check: a job did not succeed or a stage's output differs (result.json)")
    return result


if __name__ == "__main__":
    main()
