"""initial catalog: runs, checkpoints, shards, votes, tags, events

Revision ID: 0001
Revises: 
"""
from alembic import op
import sqlalchemy as sa


revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('runs',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_good_id', sa.Integer(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_runs')),
    sa.UniqueConstraint('name', name=op.f('uq_runs_name'))
    )
    op.create_table('checkpoints',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('step', sa.BigInteger(), nullable=False),
    sa.Column('attempt', sa.String(length=64), nullable=False),
    sa.Column('world_size', sa.Integer(), nullable=False),
    sa.Column('parent_id', sa.Integer(), nullable=True),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('bytes', sa.BigInteger(), nullable=False),
    sa.Column('lease_expires_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('committed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('manifest_key', sa.String(length=256), nullable=True),
    sa.Column('manifest_hash', sa.String(length=32), nullable=True),
    sa.ForeignKeyConstraint(['parent_id'], ['checkpoints.id'], name=op.f('fk_checkpoints_parent_id_checkpoints')),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_checkpoints_run_id_runs')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_checkpoints')),
    sa.UniqueConstraint('run_id', 'step', 'attempt', name='uq_checkpoints_run_step_attempt')
    )
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.create_index('ix_checkpoints_run_status_step', ['run_id', 'status', 'step'], unique=False)
        batch_op.create_index('ix_checkpoints_status_lease', ['status', 'lease_expires_at'], unique=False)

    # runs.last_good_id and checkpoints.run_id point at each other: add this one last.
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.create_foreign_key(op.f('fk_runs_last_good_id_checkpoints'), 'checkpoints', ['last_good_id'], ['id'])

    op.create_table('events',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=True),
    sa.Column('checkpoint_id', sa.Integer(), nullable=True),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('data_json', sa.Text(), nullable=False),
    sa.ForeignKeyConstraint(['checkpoint_id'], ['checkpoints.id'], name=op.f('fk_events_checkpoint_id_checkpoints')),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_events_run_id_runs')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_events'))
    )
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.create_index('ix_events_run_at', ['run_id', 'at'], unique=False)

    op.create_table('shards',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('checkpoint_id', sa.Integer(), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('file_name', sa.String(length=200), nullable=False),
    sa.Column('size', sa.BigInteger(), nullable=False),
    sa.Column('xxh3_128', sa.String(length=32), nullable=False),
    sa.Column('blob_key', sa.String(length=256), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('index_json', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['checkpoint_id'], ['checkpoints.id'], name=op.f('fk_shards_checkpoint_id_checkpoints')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_shards')),
    sa.UniqueConstraint('checkpoint_id', 'rank', 'file_name', name='uq_shards_ckpt_rank_file')
    )
    op.create_table('tags',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('checkpoint_id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['checkpoint_id'], ['checkpoints.id'], name=op.f('fk_tags_checkpoint_id_checkpoints')),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_tags_run_id_runs')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_tags'))
    )
    with op.batch_alter_table('tags', schema=None) as batch_op:
        batch_op.create_index('ix_tags_run_name', ['run_id', 'name'], unique=False)

    op.create_table('votes',
    sa.Column('checkpoint_id', sa.Integer(), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('files_json', sa.Text(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['checkpoint_id'], ['checkpoints.id'], name=op.f('fk_votes_checkpoint_id_checkpoints')),
    sa.PrimaryKeyConstraint('checkpoint_id', 'rank', name=op.f('pk_votes'))
    )


def downgrade() -> None:
    op.drop_table('votes')
    with op.batch_alter_table('tags', schema=None) as batch_op:
        batch_op.drop_index('ix_tags_run_name')

    op.drop_table('tags')
    op.drop_table('shards')
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.drop_index('ix_events_run_at')

    op.drop_table('events')
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.drop_index('ix_checkpoints_status_lease')
        batch_op.drop_index('ix_checkpoints_run_status_step')

    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_constraint(op.f('fk_runs_last_good_id_checkpoints'), type_='foreignkey')
    op.drop_table('checkpoints')
    op.drop_table('runs')
