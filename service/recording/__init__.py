"""The history store: every step's record, written and read back. ``records.StepRecord`` is
the row; ``history`` writes (idempotent upserts) and reads bounded ranges; ``ingest`` and
``heldflush`` are the PostgreSQL append paths a running job's flush takes; ``rollups`` keeps
the buckets; ``columnar`` reads columns into numpy and writes JSON, Arrow or Parquet;
``epochmetrics`` and ``gradients`` store the per-epoch metrics and the gradient samples."""
