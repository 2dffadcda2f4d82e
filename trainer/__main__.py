"""python -m trainer CONFIG.yaml [key=value ...]

Trains an EAGLE-3 head on a capture folder with Ray Train + DeepSpeed, resuming from the latest
checkpoint in out_dir when there is one, then exports the best head (SGLang and speculators formats).
"""
from __future__ import annotations

import pipeline.cluster  # noqa: F401  (sets the Ray env defaults before ray is imported)
from pipeline import storage
from pipeline.yaml_config import config_arguments, errors_exit, load_or_exit
from trainer.config import TrainConfig


def main(argv: list[str] | None = None) -> dict:
    args = config_arguments("python -m trainer", __doc__, "optim.lr=3e-4").parse_args(argv)
    cfg = load_or_exit(TrainConfig, args.config, args.overrides)
    if cfg.onpolicy.rounds:
        raise SystemExit("trainer: onpolicy.rounds: the rounds decode with the serving engine; run them with "
                         "`eagleray train` (infer/onpolicy.py)")
    from trainer.driver import run_training

    with errors_exit("trainer", root_cause=True):
        report = run_training(cfg)
    best = report.get("best") or {}
    held_out = (f"best at step {best['step']}: held-out simulated tau {best['sim_tau']:.2f}, first-token acceptance "
                f"{best['val_acc'][0]:.2f}; " if best.get("val_acc") else "")
    print(f"[train] {report['steps']} steps in {report['wall_s']:.0f} s, {report.get('tokens_per_s') or 0:.0f} "
          f"tokens/s; {held_out}heads in {storage.redact(cfg.out_dir)} ({', '.join(report['exports'])}; report.json)", flush=True)
    return report


if __name__ == "__main__":
    main()
