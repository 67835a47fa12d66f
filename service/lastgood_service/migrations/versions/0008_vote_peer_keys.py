"""votes.peer_key: the commitment a rank's vote carries for its peer checks

The SHA-256 of a secret only the voting rank holds (lastgood/wire/peerkey.py): a peer check
of that rank's assignment is accepted only with the secret (domain/peer/verification_modes.py).
NULL: a vote without one (a client that does no peer checks, or a vote recorded before this
column); such a rank's assignment is hashed by the service instead.

Revision ID: 0008
Revises: 0007
"""
from alembic import op
import sqlalchemy as sa


revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('votes', sa.Column('peer_key', sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('votes') as batch:
        batch.drop_column('peer_key')
