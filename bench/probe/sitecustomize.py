"""cProfile of a process's event loop thread in windows that a bench opens and closes
(bench/calls_per_task.py): imported at start-up from PYTHONPATH when
`BENCH_CALLS_DIR` is set, inert otherwise.

The bench writes `<dir>/on-<i>` to open window i and `<dir>/off-<i>` to close it;
this dumps the window's statistics to `<dir>/<i>.prof` and writes `<dir>/done-<i>`.
The profiler is switched on and off on the loop's own thread (cProfile profiles the
thread that enables it), through `call_soon_threadsafe` from a watcher thread; the
loop is the first one uvloop makes (the worker's and the pass-throughs' only one).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

_DIR = os.environ.get("BENCH_CALLS_DIR")

if _DIR:
    import cProfile

    import uvloop

    _loops: list[object] = []
    _new_event_loop = uvloop.new_event_loop

    def _first_loop_kept() -> object:
        loop = _new_event_loop()
        _loops.append(loop)
        return loop

    uvloop.new_event_loop = _first_loop_kept

    def _wait_for(path: Path) -> None:
        while not path.exists():
            time.sleep(0.05)

    def _watch(folder: Path) -> None:
        i = 0
        while True:
            _wait_for(folder / f"on-{i}")
            profiler = cProfile.Profile()
            loop = _loops[0]
            loop.call_soon_threadsafe(profiler.enable)  # type: ignore[attr-defined]
            _wait_for(folder / f"off-{i}")
            dumped = threading.Event()

            def dump(
                profiler: cProfile.Profile = profiler, i: int = i, dumped: threading.Event = dumped
            ) -> None:
                profiler.disable()
                profiler.dump_stats(str(folder / f"{i}.prof"))
                dumped.set()

            loop.call_soon_threadsafe(dump)  # type: ignore[attr-defined]
            dumped.wait(60)
            (folder / f"done-{i}").write_text("")
            i += 1

    threading.Thread(target=_watch, args=(Path(_DIR),), daemon=True).start()
