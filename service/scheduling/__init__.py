"""Jobs through their lives: ``jobs`` (the state machine: create_job, claim_next, finish,
requeue, each one guarded UPDATE), ``fairshare`` (the claim order, usage, queue positions),
``preemption`` (which running job makes room for which waiting one), ``slots`` (the slots
workers offer) and ``sweeps`` (one job per precision variant of a base spec). Decided from the
database alone, so every host agrees (docs/scheduling.md)."""
