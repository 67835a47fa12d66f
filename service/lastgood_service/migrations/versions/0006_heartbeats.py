"""heartbeats: the latest beat per (run, rank)

One row per rank of a run, updated in place by every beat (domain/health/heartbeats.py).

Revision ID: 0006
Revises: 0005
"""
from alembic import op
import sqlalchemy as sa


revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('heartbeats',
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('world_size', sa.Integer(), nullable=False),
    sa.Column('generation', sa.BigInteger(), nullable=False),
    sa.Column('attempt', sa.String(length=64), nullable=True),
    sa.Column('step', sa.BigInteger(), nullable=True),
    sa.Column('step_seconds', sa.Float(), nullable=True),
    sa.Column('typical_step_s', sa.Float(), nullable=True),
    sa.Column('slowest_step_s', sa.Float(), nullable=True),
    sa.Column('save_stall_s', sa.Float(), nullable=True),
    sa.Column('period_s', sa.Float(), nullable=True),
    sa.Column('phase', sa.String(length=16), nullable=False),
    sa.Column('beats', sa.BigInteger(), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('beat_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('progress_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('outlier_since', sa.DateTime(timezone=True), nullable=True),
    sa.Column('verdict', sa.String(length=16), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_heartbeats_run_id_runs')),
    sa.PrimaryKeyConstraint('run_id', 'rank', name=op.f('pk_heartbeats'))
    )
    op.create_index('ix_heartbeats_beat_at', 'heartbeats', ['beat_at'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_heartbeats_beat_at', table_name='heartbeats')
    op.drop_table('heartbeats')
