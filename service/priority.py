"""The API's CPU priority, below the training's.

On a server whose cores the training also needs (its input pipeline, its step loop, and on
a CPU-only host the maths itself), a poll answered at the same priority as the training
takes a core from it just when a step needs both: TensorFlow splits an op across its
threads and waits for the slowest, so a preempted thread stalls the step. With the API at
a lower priority the scheduler runs it when a core is free, which is most of the time;
under contention the polls wait a little longer and the training does not.

Linux keeps a nice value per thread, and a new thread or process starts with its creator's.
``halfway serve`` lowers the event loop's thread once the embedded supervisor's thread has
started: the API, and the thread pool it creates later, run lower; the supervisor, and the
training children it spawns, keep the priority they were started with.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger("halfway.api")


def lower_this_thread(nice: int) -> None:
    """Add ``nice`` to the calling thread's nice value (Linux only: elsewhere the value is
    the whole process's, which would lower the training too)."""
    if nice <= 0 or sys.platform != "linux":
        return
    tid = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, current + nice))
    except OSError as exc:
        log.warning("could not lower the API's CPU priority: %s", exc)
