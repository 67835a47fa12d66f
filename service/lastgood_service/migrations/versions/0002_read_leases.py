"""read leases, deleted checkpoints

Revision ID: 0002
Revises: 0001
"""
from alembic import op
import sqlalchemy as sa


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('read_leases',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('checkpoint_id', sa.Integer(), nullable=False),
    sa.Column('holder', sa.String(length=128), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['checkpoint_id'], ['checkpoints.id'], name=op.f('fk_read_leases_checkpoint_id_checkpoints')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_read_leases'))
    )
    with op.batch_alter_table('read_leases', schema=None) as batch_op:
        batch_op.create_index('ix_read_leases_ckpt_expires', ['checkpoint_id', 'expires_at'], unique=False)

    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.add_column(sa.Column('deleted_at', sa.DateTime(timezone=True), nullable=True))



def downgrade() -> None:
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.drop_column('deleted_at')

    with op.batch_alter_table('read_leases', schema=None) as batch_op:
        batch_op.drop_index('ix_read_leases_ckpt_expires')

    op.drop_table('read_leases')
