"""launch generations (fencing)

Every launch of a job registers and gets the next generation of its run; checkpoints
record the generation that began them. Existing rows get 0: clients that never
registered, which are never fenced.

Revision ID: 0004
Revises: 0003
"""
from alembic import op
import sqlalchemy as sa


revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('launches',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('attempt', sa.String(length=64), nullable=False),
    sa.Column('generation', sa.BigInteger(), nullable=False),
    sa.Column('world_size', sa.Integer(), nullable=False),
    sa.Column('registered_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_launches_run_id_runs')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_launches')),
    sa.UniqueConstraint('run_id', 'attempt', name='uq_launches_run_attempt'),
    sa.UniqueConstraint('run_id', 'generation', name='uq_launches_run_generation')
    )
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('generation', sa.BigInteger(), server_default='0', nullable=False))
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.add_column(sa.Column('generation', sa.BigInteger(), server_default='0', nullable=False))


def downgrade() -> None:
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.drop_column('generation')
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_column('generation')
    op.drop_table('launches')
