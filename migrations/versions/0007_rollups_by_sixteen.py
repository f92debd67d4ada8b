"""Rollup levels of 64, 1024, 16384 and 262144 steps (each 16 blocks of the level below),
where there were 64, 4096 and 262144 (each 64).

A bucket page reads, for each bucket, the blocks of the coarsest level that fits in it: up to
64 of them with 64 blocks a level, up to 16 now. 1000 points over a million steps read 15,625
level-0 blocks; they now read 977 blocks of 1024 steps. A flush writes one more block summary.

Level 0 (64 steps) is the same in both layouts. The levels above it are rebuilt from it, each
from the one below, in SQL that both databases run: each block's minima, maxima and counts
from its blocks below, and its last loss and scale from the last of them.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NEW_LEVELS = (64, 1024, 16384, 262144)
OLD_LEVELS = (64, 4096, 262144)

# One level from the one below it, for every job. ``block / per`` truncates on both databases
# (integers), and the greatest block of a group is the one holding its last step.
_FROM_BELOW = """
INSERT INTO step_rollup (job_id, level, block, first_step, last_step, count, loss_min,
                         loss_max, loss_last, scale_min, scale_max, scale_last,
                         overflow_count, nonfinite_loss_count)
SELECT g.job_id, {level}, g.block, g.first_step, g.last_step, g.n, g.loss_min, g.loss_max,
       r.loss_last, g.scale_min, g.scale_max, r.scale_last, g.overflows, g.nonfinite
FROM (
    SELECT job_id, block / {per} AS block, MIN(first_step) AS first_step,
           MAX(last_step) AS last_step, SUM(count) AS n, MIN(loss_min) AS loss_min,
           MAX(loss_max) AS loss_max, MIN(scale_min) AS scale_min, MAX(scale_max) AS scale_max,
           SUM(overflow_count) AS overflows, SUM(nonfinite_loss_count) AS nonfinite,
           MAX(block) AS last_block
    FROM step_rollup
    WHERE level = {below}
    GROUP BY job_id, block / {per}
) AS g
JOIN step_rollup AS r
  ON r.job_id = g.job_id AND r.level = {below} AND r.block = g.last_block
"""


def _rebuild(levels: tuple[int, ...]) -> None:
    op.execute("DELETE FROM step_rollup WHERE level > 0")
    for level in range(1, len(levels)):
        per = levels[level] // levels[level - 1]
        op.execute(_FROM_BELOW.format(level=level, below=level - 1, per=per))


def upgrade() -> None:
    _rebuild(NEW_LEVELS)


def downgrade() -> None:
    _rebuild(OLD_LEVELS)
