"""Starting or joining Ray the same way from every entry point."""
from __future__ import annotations

import os
import time

# Stay on 127.0.0.1 and let Ray's own clients in; Ray Train's controller polls its workers every 0.25 s,
# not 2 s, so a run ends when its workers do (docs/ARCHITECTURE.md §13). Set before Ray starts: its
# processes inherit them.
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "TOKENIZERS_PARALLELISM": "false", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25",
           # The raylet warns on the console once a node has started 4x this many worker processes; it
           # defaults to the node's CPUs, and a training run on 2 CPUs (controller, 2 workers, Ray Data's
           # tasks) starts 8 by design.
           "RAY_worker_maximum_startup_concurrency": "4"}
for _k, _v in RAY_ENV.items():
    os.environ.setdefault(_k, _v)


def _name_deepspeed_accelerator() -> None:
    """DeepSpeed guesses its accelerator when first imported (transformers imports it whenever it is
    installed) and logs a warning each time it falls back to the CPU; with no CUDA device we name the CPU
    ourselves. A DS_ACCELERATOR the user set stays."""
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"


_name_deepspeed_accelerator()


# glibc hands a freed block of 32 MB or more straight back to the kernel (munmap) and trims its heaps, so a
# CPU step that frees and reallocates its activations page-faults them in again, zeroed by the kernel, at
# every step: 6-7% of a SmolLM2-shaped training step was system time (docs/ARCHITECTURE.md §13). One heap,
# never trimmed, no mmap: freed memory stays in the process for the next step.
KEEP_FREED_MEMORY = ("glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:"
                     "glibc.malloc.trim_threshold=68719476736")


def cpu_worker_env(keep_freed_memory: bool) -> dict[str, str]:
    """Environment for Ray worker processes that run torch on CPU (a runtime_env's env_vars). A
    GLIBC_TUNABLES already set where the job starts is the user's choice and stays; other C libraries
    ignore the variable."""
    if not keep_freed_memory or "GLIBC_TUNABLES" in os.environ:
        return {}
    return {"GLIBC_TUNABLES": KEEP_FREED_MEMORY}


def verbose() -> bool:
    """Ray worker and actor logs on the console (`--verbose` or EAGLERAY_VERBOSE=1); else they stay in
    Ray's log files and the console shows each stage's one-line summary."""
    return os.environ.get("EAGLERAY_VERBOSE", "") not in ("", "0")


_STARTED_LOCAL = False


def _no_colour_reset_at_exit() -> None:
    """Ray's CLI logger runs `colorama.init()` as Ray starts, which registers an exit hook that writes an
    ANSI reset to a terminal: a stray blank line after every stage of the demo. Our drivers print no colour."""
    import atexit
    import sys

    initialise = sys.modules.get("colorama.initialise")
    if initialise is not None:
        atexit.unregister(initialise.reset_all)


def started_local_ray() -> bool:
    """Whether this process started the Ray it is connected to (so stopping it ends everything on it)."""
    import ray

    return _STARTED_LOCAL and ray.is_initialized()


def ensure_ray(address: str | None = None, num_cpus: int | None = None) -> str:
    """Join `address` (or $RAY_ADDRESS, as under `ray job submit`), else start a local Ray on 127.0.0.1.
    Returns how it connected and where the worker logs are, for the log."""
    import ray

    if ray.is_initialized():
        return "already connected"
    address = address or os.environ.get("RAY_ADDRESS")
    global _STARTED_LOCAL
    if address:
        ray.init(address=address, log_to_driver=verbose())
        how = f"joined {address}"
    else:
        # The dashboard serves the state API that Ray Train's controller polls; without it, it logs every second.
        ray.init(num_cpus=num_cpus, include_dashboard=True, dashboard_host="127.0.0.1",
                 _node_ip_address="127.0.0.1", log_to_driver=verbose(), logging_level="WARNING")
        how, _STARTED_LOCAL = "started a local Ray", True
    _no_colour_reset_at_exit()
    try:
        logs = ray._private.worker.global_worker.node.get_logs_dir_path()
    except AttributeError:  # joined through a client: the logs live on the cluster
        logs = None
    return how + (f" (worker logs: {logs}; --verbose shows them here)" if logs and not verbose() else "")


def quiet_ray_data() -> None:
    """Deterministic block order and no per-operator progress or memory-advice spam in logs."""
    import logging

    import ray

    ctx = ray.data.DataContext.get_current()  # imports ray.data, which sets up its loggers: quiet them after
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    # Its one warning here only says that the bars are off, which is this function's choice.
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    # Its high-memory detector repeats a 12-line advice every 30 s for each actor stage that holds more than
    # it requested (a vLLM regenerator: ~4 GiB): our stages size their memory by config
    # (regenerate.vllm.kv_cache_gb, capture.batch_tokens), so the advice is noise in the stage's output.
    ctx.issue_detectors_config.high_memory_detector_config.detection_time_interval_s = -1


def map_with_actors(ds, cls, **kwargs):
    """`ds.map_batches(cls, ...)` on an actor pool whose actors Ray does not restart (regeneration's and a
    pipeline capture's). Restartable actors make Ray's core log an error line at every actor's start,
    because Ray Data passes them their arguments through the object store (ray-project/ray#57733: a false
    alarm, the driver holds those references). Those stages write finished parts and resume from them, so
    `retry_lost` reruns what a lost actor left undone instead. A streamed epoch (trainer/sources.py) has no
    files to resume from and keeps Ray Data's restarts. This Ray takes `max_restarts` only through the
    deprecated `**ray_remote_args`, so that deprecation warning is dropped for this one call."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
        return ds.map_batches(cls, max_restarts=0, **kwargs)


def lost_worker(exc: BaseException) -> BaseException | None:
    """The exception in `exc`'s chain (itself or one it was raised from) that says a process or node died,
    not that our code failed; None when there is none."""
    from ray import exceptions as rx

    lost = (rx.RayActorError, rx.NodeDiedError, rx.WorkerCrashedError, rx.ObjectLostError, rx.LocalRayletDiedError)
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, lost):
            # an __init__ that raised is our code's error
            return None if getattr(exc, "actor_init_failed", False) else exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def await_verdict(loss: BaseException, timeout_s: float = 90.0) -> float:
    """Wait until Ray's GCS holds the lost actor dead; -> seconds waited. A node whose raylet died unseen
    (`kill -9`, a lost host) stays alive in the GCS until its health checks time out (~15-30 s at Ray's
    defaults), and until then the next attempt's new actors may be placed on it and lost as well (seen
    in tests/test_cluster.py: capture's attempt 2 lost so). A loss with no actor, or a GCS
    that cannot be asked, waits nothing."""
    actor = getattr(loss, "actor_id", None)
    if not actor:
        return 0.0
    from ray._private import state  # the GCS's actor table; Ray's public state API needs the dashboard

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if state.actors(actor_id=actor).get("State") in ("DEAD", None):
                break
        except Exception:  # noqa: BLE001 - no verdict to wait for; the retry goes ahead as before
            break
        time.sleep(1.0)
    return time.monotonic() - t0


def retry_lost(stage: str, run, attempts: int = 3):
    """`run()`, again after a lost actor or node (`lost_worker`), at most `attempts` times in all. `run`
    must redo only what is not yet written (capture's shards, regeneration's chunks), so a retry costs the
    lost work only. Each retry starts once the GCS holds the lost actor dead (`await_verdict`). Any other
    error, and the last loss, propagate."""
    for attempt in range(1, attempts + 1):
        try:
            return run()
        except Exception as exc:  # noqa: BLE001 - filtered by lost_worker, re-raised otherwise
            loss = lost_worker(exc) if attempt < attempts else None
            if loss is None:
                raise
            waited = await_verdict(loss)
            print(f"[{stage}] a worker was lost ({type(loss).__name__}); attempt {attempt + 1} of {attempts} "
                  f"redoes the unfinished parts (after {waited:.0f} s for Ray to declare it dead)", flush=True)


def check_actor_cpus(key: str, num_actors: int, cpus_per_actor: float) -> None:
    """Refuse an actor pool that takes every CPU of the cluster: Ray Data's own tasks (reads, repartition)
    then never get one, and the job waits forever with idle actors (seen with 1 actor x 2 CPUs on 2 cores)."""
    import ray

    total = ray.cluster_resources().get("CPU", 0)
    if total and num_actors * cpus_per_actor > total - 0.5:
        raise ValueError(f"{key}: {num_actors} actor(s) x {cpus_per_actor:g} CPU leave no CPU of this {total:g}-CPU "
                         f"cluster for Ray Data's own tasks, so the job would wait forever; give the actors at most "
                         f"{max(0.0, total - 1):g} CPU in all (an actor's torch / vLLM threads may still use "
                         f"more cores)")
