"""A worker process whose clock is off by ``SKEW`` seconds: every time Halfway's code reads
the wall clock (``service.models.utcnow``) is shifted, as on a host whose clock has drifted.
Runs the supervisor with the fake trainer until SIGTERM.

    python -m tests.skewed_worker SKEW WORKER_ID
"""

from __future__ import annotations

import signal
import sys
from datetime import timedelta

import service.models


def main() -> None:
    skew, worker_id = float(sys.argv[1]), sys.argv[2]
    honest = service.models.utcnow
    # Patched before anything else imports it, so every `from service.models import utcnow`
    # (the supervisor's default clock among them) gets the skewed one.
    service.models.utcnow = lambda: honest() + timedelta(seconds=skew)

    from service.db import Database
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
