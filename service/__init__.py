"""Halfway's server side, one folder per layer (docs/architecture.md). Never imports TensorFlow
or Keras: only the training child (``workers/``) does.

- ``api/``: the HTTP layer: the FastAPI app, its routes, the polls and streams dashboards read,
  and the bodies it answers.
- ``specs/``: what users write (the job and sweep specs) and what Halfway makes of it.
- ``scheduling/``: the job state machine, the claim order (fair share), preemption, slots.
- ``recording/``: the history store: every step's record, rollups, gradient samples, columns.
- ``files/``: where files live (local or S3), code bundles and datasets.
- ``people/``: users, tokens and who may run code.
- ``database/``: engines, the ORM models, the database's clock, migrations.
- ``client/``: the Python client and the ``halfway`` commands that talk to a server.
- Beside them, what every layer shares: ``settings``, ``errors``, ``vocabulary``, ``logs``,
  ``metrics`` (Prometheus), ``priority``; and ``cli``, the entry point.

Imports point one way: ``api`` → the domain folders → ``database``; nothing below ``api``
imports it (``tests/test_layers.py`` checks)."""
