"""per-run retention, incremental GC bookkeeping, indexes for the page and GC

A run may carry its own retention (NULL: the service default). GC remembers per run the
newest event it saw, the policy it applied and when time alone may make something
deletable, so a pass plans only runs where something changed. The indexes serve the
runs list and overview (counts and bytes by status), a run's newest event, events by
kind, a run's checkpoints in creation order, and the events of a checkpoint.

Revision ID: 0005
Revises: 0004
"""
from alembic import op
import sqlalchemy as sa


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('retention', sa.String(length=512), nullable=True))
        batch_op.add_column(sa.Column('gc_event_id', sa.BigInteger(), server_default='0', nullable=False))
        batch_op.add_column(sa.Column('gc_policy', sa.String(length=512), nullable=True))
        batch_op.add_column(sa.Column('gc_due_at', sa.DateTime(timezone=True), nullable=True))
    op.create_index('ix_checkpoints_run_status_bytes', 'checkpoints', ['run_id', 'status', 'bytes'])
    op.create_index('ix_checkpoints_run_id', 'checkpoints', ['run_id', 'id'])
    op.create_index('ix_events_run_id', 'events', ['run_id', 'id'])
    op.create_index('ix_events_run_kind_at', 'events', ['run_id', 'kind', 'at'])
    op.create_index('ix_events_checkpoint', 'events', ['checkpoint_id'])


def downgrade() -> None:
    op.drop_index('ix_events_checkpoint', table_name='events')
    op.drop_index('ix_events_run_kind_at', table_name='events')
    op.drop_index('ix_events_run_id', table_name='events')
    op.drop_index('ix_checkpoints_run_id', table_name='checkpoints')
    op.drop_index('ix_checkpoints_run_status_bytes', table_name='checkpoints')
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_column('gc_due_at')
        batch_op.drop_column('gc_policy')
        batch_op.drop_column('gc_event_id')
        batch_op.drop_column('retention')
