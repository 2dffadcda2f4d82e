"""One progress bar per long stage, fed by polling what the stage writes (part files, shards, progress.json).

Ray Data's own bars are off (pipeline/cluster.py `ray_data_settings`); the work happens in actors, so the driver
watches the files they finish. A bar redraws only when its count moves, so logs stay short off a terminal.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator


@contextmanager
def progress_bar(desc: str, total: int, poll: Callable[[], int | tuple[int, dict]], unit: str = "it",
                 every_s: float = 1.0) -> Iterator[None]:
    """Show `poll()` (a count, or a count and a postfix dict) against `total` while the block runs."""
    from tqdm import tqdm

    stop = threading.Event()
    bar = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, mininterval=5)

    def tick():
        try:
            got = poll()
        except (OSError, ValueError, KeyError):  # a file mid-write: try again next tick
            got = None
        if got is not None:
            n, post = got if isinstance(got, tuple) else (got, None)
            if n != bar.n:
                if post:
                    bar.set_postfix(post, refresh=False)
                bar.update(n - bar.n)

    def run():
        while not stop.is_set():
            tick()
            stop.wait(every_s)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=5)
        tick()  # the last part written since the previous poll
        bar.close()
