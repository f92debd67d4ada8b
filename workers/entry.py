"""``python -m workers.entry``: the first code of a training child, in its sandbox.

The launcher writes the child's payload as JSON on standard input and passes the write end of
the message pipe as a file descriptor (its number in the payload); this imports the trainer
the payload names (``module:function``, ``workers.child:run`` in production, a fake in the
supervisor's tests) and hands it both. JSON, not pickle: nothing the child receives can run
code as it is read, and nothing it is given is more than plain data.

A graceful stop arrives as a byte on the control pipe and becomes a SIGTERM to this process,
so the trainer handles it as any SIGTERM: the supervisor cannot name this process's pid
inside the sandbox's PID namespace, and needs not.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import threading
from multiprocessing.connection import Connection

STOP = b"T"


def main() -> None:
    payload = json.load(sys.stdin)
    sys.stdin.close()
    module_name, _, function = payload.pop("trainer").partition(":")
    trainer = getattr(importlib.import_module(module_name), function)
    conn = Connection(payload.pop("message_fd"), readable=False)
    control = payload.pop("control_fd")
    threading.Thread(target=_listen, args=(control,), name="halfway-control", daemon=True).start()
    trainer(payload, conn)


def _listen(control: int) -> None:
    while (byte := os.read(control, 1)) != b"":
        if byte == STOP:
            os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    main()
