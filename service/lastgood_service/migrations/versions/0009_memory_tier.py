"""the memory tier: checkpoints.tier and .replicas, node agents, their copies

docs/memory-tier.md. `checkpoints.tier` is `durable` for every checkpoint recorded before
(and every one begun without a tier); `replicas` is a memory checkpoint's partner copies
per file. `agents`: the node agents, with the SHA-256 of each one's key. `copies`: which
agent reported which file of a memory checkpoint, with its own hash of the bytes it holds.
No table is rebuilt (SQLite's batch mode would drop the run_stats triggers of 0007).

Revision ID: 0009
Revises: 0008
"""
from alembic import op
import sqlalchemy as sa


revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('checkpoints', sa.Column('tier', sa.String(length=16), nullable=False, server_default='durable'))
    op.add_column('checkpoints', sa.Column('replicas', sa.Integer(), nullable=False, server_default='0'))
    op.create_table(
        'agents',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('host', sa.String(length=64), nullable=False),
        sa.Column('rack', sa.String(length=64), nullable=False, server_default=''),
        sa.Column('switch', sa.String(length=64), nullable=False, server_default=''),
        sa.Column('address', sa.String(length=255), nullable=False),
        sa.Column('key_digest', sa.String(length=64), nullable=False),
        sa.Column('registered_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('retired_at', sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_agents')),
    )
    op.create_index('ix_agents_host_address', 'agents', ['host', 'address'])
    op.create_table(
        'copies',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('checkpoint_id', sa.Integer(), nullable=False),
        sa.Column('rank', sa.Integer(), nullable=False),
        sa.Column('file_name', sa.String(length=200), nullable=False),
        sa.Column('agent_id', sa.Integer(), nullable=False),
        sa.Column('size', sa.BigInteger(), nullable=False),
        sa.Column('xxh3_128', sa.String(length=32), nullable=False),
        sa.Column('reported_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['checkpoint_id'], ['checkpoints.id'],
                                name=op.f('fk_copies_checkpoint_id_checkpoints')),
        sa.ForeignKeyConstraint(['agent_id'], ['agents.id'], name=op.f('fk_copies_agent_id_agents')),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_copies')),
        sa.UniqueConstraint('checkpoint_id', 'rank', 'file_name', 'agent_id', name='uq_copies_ckpt_rank_file_agent'),
    )
    op.create_index('ix_copies_agent', 'copies', ['agent_id', 'checkpoint_id'])


def downgrade() -> None:
    op.drop_index('ix_copies_agent', table_name='copies')
    op.drop_table('copies')
    op.drop_index('ix_agents_host_address', table_name='agents')
    op.drop_table('agents')
    # ALTER TABLE ... DROP COLUMN (SQLite >= 3.35), not a batch rebuild of the table: a
    # rebuild would drop the run_stats triggers on it (migration 0007)
    op.drop_column('checkpoints', 'replicas')
    op.drop_column('checkpoints', 'tier')
