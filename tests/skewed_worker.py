"""A worker process for tests/test_clock_skew.py: the supervisor with the fake trainer, until
SIGTERM. Its clock is shifted from outside, at the process level (tests/clockshift.c through
LD_PRELOAD), as on a host whose clock has drifted; it first prints the wall clock it sees, so
the test can check the shift took.

    python -m tests.skewed_worker WORKER_ID
"""

from __future__ import annotations

import signal
import sys
import time


def main() -> None:
    worker_id = sys.argv[1]
    print(f"wall clock: {time.time():.3f}", flush=True)

    from service.database.db import Database
    from service.logs import configure
    from service.settings import Settings
    from tests import fakes
    from workers.supervisor import Supervisor

    configure(False)
    settings = Settings()
    db = Database.connect(settings.resolved_database_url())
    supervisor = Supervisor(db, settings, trainer=fakes.trainer, worker_id=worker_id)
    signal.signal(signal.SIGTERM, lambda *_: supervisor.stop())
    supervisor.run_forever()
    db.dispose()


if __name__ == "__main__":
    main()
