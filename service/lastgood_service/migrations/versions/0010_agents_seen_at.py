"""agents.seen_at: when the service last heard from each node agent

docs/memory-tier.md. An agent's registration, copy reports and live lists set it; the
placement list (`GET /api/v1/agents`) leaves out an agent not seen for
LASTGOOD_AGENT_TTL_SECONDS. Rows registered before take their registration time.

Revision ID: 0010
Revises: 0009
"""
from alembic import op
import sqlalchemy as sa


revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('agents', sa.Column('seen_at', sa.DateTime(timezone=True), nullable=True))
    op.execute("UPDATE agents SET seen_at = registered_at")


def downgrade() -> None:
    with op.batch_alter_table('agents') as batch:
        batch.drop_column('seen_at')
