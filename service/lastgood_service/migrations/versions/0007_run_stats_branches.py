"""run_stats: per-run counters kept by the catalog itself; stored branches

Stored branches: `checkpoints.branch`, written by domain/runs/branches.py when a checkpoint is
begun, committed or rebuilt, so a lineage page reads an index range of the run instead of
the whole run; indexes on (run_id, parent_id) and (run_id, branch) serve it. Existing
catalogs get theirs computed here, run by run, by the rule's one owner
(lineage.assign_branches).

One row per run: its checkpoints by status, the bytes of those not DELETED, and the
newest step begun. The runs list and the overview read these O(runs) rows instead of
counting O(checkpoints) rows. Triggers on `checkpoints` keep them, in the transaction of
the change that moves them, whoever writes (begin, commit, abort, expiry, corruption,
rollback, GC, repair, a bulk UPDATE): one owner, no code path that can forget. On
PostgreSQL the trigger is a deferred constraint trigger, so a transaction takes the
run's counter row lock only at COMMIT, after every checkpoint row lock it takes: the
counters add no lock-order deadlock and no wait while the transaction runs.

`changes` counts every change that can alter what a retention policy keeps: a checkpoint
begun or changing status (but to DELETED: deleting what no policy keeps changes nothing
they keep), a tag, pin or alias set or removed, last-good moved. GC reads a run's view
once, outside its write transactions, and re-reads it under the lock only if `changes`
moved (domain/gc/).

A later migration that rebuilds `checkpoints` or `runs` on SQLite (batch_alter_table
copies the table) drops these triggers with it and must create them again
(tests/catalog/test_run_stats.py checks they exist at head).

Revision ID: 0007
Revises: 0006
"""
from alembic import op
import sqlalchemy as sa


revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None

STATUSES = ("PENDING", "COMMITTED", "ABANDONED", "CORRUPT", "DELETED")
COLUMNS = ("pending", "committed", "abandoned", "corrupt", "deleted")


def _delta(row: str, sign: str, as_int: str) -> str:
    """SET items adding (sign '+') or taking away ('-') one checkpoint row's contribution."""
    items = [f"{c} = {c} {sign} {as_int.format(f'{row}.status = ' + repr(s))}" for c, s in zip(COLUMNS, STATUSES)]
    items.append(f"bytes_stored = bytes_stored {sign} CASE WHEN {row}.status <> 'DELETED' THEN {row}.bytes ELSE 0 END")
    return ", ".join(items)


SQLITE = [
    """CREATE TRIGGER trg_run_stats_run_insert AFTER INSERT ON runs
       BEGIN INSERT INTO run_stats (run_id) VALUES (NEW.id); END""",
    f"""CREATE TRIGGER trg_run_stats_ck_insert AFTER INSERT ON checkpoints
       BEGIN UPDATE run_stats SET {_delta('NEW', '+', '({})')}, changes = changes + 1,
             newest_step = max(coalesce(newest_step, NEW.step), NEW.step) WHERE run_id = NEW.run_id; END""",
    f"""CREATE TRIGGER trg_run_stats_ck_update AFTER UPDATE OF status, bytes, step, run_id ON checkpoints
       WHEN OLD.status IS NOT NEW.status OR OLD.bytes IS NOT NEW.bytes OR OLD.step IS NOT NEW.step
            OR OLD.run_id IS NOT NEW.run_id
       BEGIN UPDATE run_stats SET {_delta('OLD', '-', '({})')} WHERE run_id = OLD.run_id;
             UPDATE run_stats SET {_delta('NEW', '+', '({})')},
             changes = changes + (NEW.status <> 'DELETED' AND OLD.status IS NOT NEW.status),
             newest_step = max(coalesce(newest_step, NEW.step), NEW.step) WHERE run_id = NEW.run_id; END""",
    """CREATE TRIGGER trg_run_stats_tag_insert AFTER INSERT ON tags
       BEGIN UPDATE run_stats SET changes = changes + 1 WHERE run_id = NEW.run_id; END""",
    """CREATE TRIGGER trg_run_stats_tag_update AFTER UPDATE ON tags
       BEGIN UPDATE run_stats SET changes = changes + 1 WHERE run_id IN (OLD.run_id, NEW.run_id); END""",
    """CREATE TRIGGER trg_run_stats_tag_delete AFTER DELETE ON tags
       BEGIN UPDATE run_stats SET changes = changes + 1 WHERE run_id = OLD.run_id; END""",
    """CREATE TRIGGER trg_run_stats_last_good AFTER UPDATE OF last_good_id ON runs
       WHEN OLD.last_good_id IS NOT NEW.last_good_id
       BEGIN UPDATE run_stats SET changes = changes + 1 WHERE run_id = NEW.id; END""",
    f"""CREATE TRIGGER trg_run_stats_ck_delete AFTER DELETE ON checkpoints
       BEGIN UPDATE run_stats SET {_delta('OLD', '-', '({})')} WHERE run_id = OLD.run_id; END""",
]

POSTGRES = [
    """CREATE FUNCTION lastgood_run_stats_run() RETURNS trigger LANGUAGE plpgsql AS $$
       BEGIN INSERT INTO run_stats (run_id) VALUES (NEW.id); RETURN NULL; END $$""",
    """CREATE TRIGGER trg_run_stats_run_insert AFTER INSERT ON runs
       FOR EACH ROW EXECUTE FUNCTION lastgood_run_stats_run()""",
    f"""CREATE FUNCTION lastgood_run_stats_ck() RETURNS trigger LANGUAGE plpgsql AS $$
       BEGIN
         IF TG_OP IN ('UPDATE', 'DELETE') THEN
           UPDATE run_stats SET {_delta('OLD', '-', '({})::int')} WHERE run_id = OLD.run_id;
         END IF;
         IF TG_OP IN ('INSERT', 'UPDATE') THEN
           UPDATE run_stats SET {_delta('NEW', '+', '({})::int')},
             changes = changes + (NEW.status <> 'DELETED'
                                  AND (TG_OP = 'INSERT' OR OLD.status IS DISTINCT FROM NEW.status))::int,
             newest_step = greatest(newest_step, NEW.step) WHERE run_id = NEW.run_id;
         END IF;
         RETURN NULL;
       END $$""",
    """CREATE CONSTRAINT TRIGGER trg_run_stats_ck_insert_delete AFTER INSERT OR DELETE ON checkpoints
       DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION lastgood_run_stats_ck()""",
    """CREATE FUNCTION lastgood_run_stats_changed() RETURNS trigger LANGUAGE plpgsql AS $$
       BEGIN
         IF TG_TABLE_NAME = 'runs' THEN
           UPDATE run_stats SET changes = changes + 1 WHERE run_id = NEW.id;
         ELSIF TG_OP = 'DELETE' THEN
           UPDATE run_stats SET changes = changes + 1 WHERE run_id = OLD.run_id;
         ELSE
           UPDATE run_stats SET changes = changes + 1 WHERE run_id = NEW.run_id;
         END IF;
         RETURN NULL;
       END $$""",
    """CREATE CONSTRAINT TRIGGER trg_run_stats_tags AFTER INSERT OR UPDATE OR DELETE ON tags
       DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION lastgood_run_stats_changed()""",
    """CREATE CONSTRAINT TRIGGER trg_run_stats_last_good AFTER UPDATE OF last_good_id ON runs
       DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (OLD.last_good_id IS DISTINCT FROM NEW.last_good_id)
       EXECUTE FUNCTION lastgood_run_stats_changed()""",
    """CREATE CONSTRAINT TRIGGER trg_run_stats_ck_update AFTER UPDATE OF status, bytes, step, run_id ON checkpoints
       DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
       WHEN (OLD.status IS DISTINCT FROM NEW.status OR OLD.bytes IS DISTINCT FROM NEW.bytes
             OR OLD.step IS DISTINCT FROM NEW.step OR OLD.run_id IS DISTINCT FROM NEW.run_id)
       EXECUTE FUNCTION lastgood_run_stats_ck()""",
]

BACKFILL = """INSERT INTO run_stats (run_id, pending, committed, abandoned, corrupt, deleted, bytes_stored, newest_step)
    SELECT runs.id, {counts},
           coalesce(sum(CASE WHEN c.status <> 'DELETED' THEN c.bytes ELSE 0 END), 0), max(c.step)
    FROM runs LEFT JOIN checkpoints c ON c.run_id = runs.id GROUP BY runs.id""".format(
    counts=", ".join(f"count(CASE WHEN c.status = '{s}' THEN 1 END)" for s in STATUSES))


def _backfill_branches() -> None:
    from lastgood_service.domain.runs.lineage import assign_branches  # the rule's one owner

    conn = op.get_bind()
    for (run_id,) in conn.execute(sa.text("SELECT id FROM runs")).all():
        rows = conn.execute(sa.text("SELECT id, parent_id, committed_at IS NOT NULL FROM checkpoints "
                                    "WHERE run_id = :r ORDER BY id"), {"r": run_id}).all()
        changed = [{"i": cid, "b": b} for cid, b in assign_branches([(i, p, bool(c)) for i, p, c in rows]).items() if b]
        if changed:
            conn.execute(sa.text("UPDATE checkpoints SET branch = :b WHERE id = :i"), changed)


def upgrade() -> None:
    op.add_column('checkpoints', sa.Column('branch', sa.Integer(), server_default='0', nullable=False))
    op.create_index('ix_checkpoints_run_parent', 'checkpoints', ['run_id', 'parent_id'])
    op.create_index('ix_checkpoints_run_branch', 'checkpoints', ['run_id', 'branch'])
    _backfill_branches()
    op.create_table('run_stats',
    sa.Column('run_id', sa.Integer(), nullable=False),
    *[sa.Column(c, sa.BigInteger(), server_default='0', nullable=False) for c in COLUMNS],
    sa.Column('bytes_stored', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('newest_step', sa.BigInteger(), nullable=True),
    sa.Column('changes', sa.BigInteger(), server_default='0', nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_run_stats_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('run_id', name=op.f('pk_run_stats'))
    )
    op.execute(BACKFILL)  # before the triggers: an existing catalog's counts, once
    for ddl in (POSTGRES if op.get_bind().dialect.name == "postgresql" else SQLITE):
        op.execute(ddl)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER trg_run_stats_last_good ON runs")
        op.execute("DROP TRIGGER trg_run_stats_tags ON tags")
        op.execute("DROP FUNCTION lastgood_run_stats_changed()")
        op.execute("DROP TRIGGER trg_run_stats_ck_update ON checkpoints")
        op.execute("DROP TRIGGER trg_run_stats_ck_insert_delete ON checkpoints")
        op.execute("DROP TRIGGER trg_run_stats_run_insert ON runs")
        op.execute("DROP FUNCTION lastgood_run_stats_ck()")
        op.execute("DROP FUNCTION lastgood_run_stats_run()")
    else:
        for name in ("trg_run_stats_last_good", "trg_run_stats_tag_delete", "trg_run_stats_tag_update",
                     "trg_run_stats_tag_insert", "trg_run_stats_ck_delete", "trg_run_stats_ck_update", "trg_run_stats_ck_insert",
                     "trg_run_stats_run_insert"):
            op.execute(f"DROP TRIGGER {name}")
    op.drop_table('run_stats')
    op.drop_index('ix_checkpoints_run_branch', table_name='checkpoints')
    op.drop_index('ix_checkpoints_run_parent', table_name='checkpoints')
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.drop_column('branch')
