"""Alembic environment for the lastgood catalog.

The URL comes from the Config the service builds (`lastgood_service.catalog.db`), or from
LASTGOOD_CATALOG_URL when alembic is run by hand (`alembic -c service/lastgood_service/migrations/alembic.ini
upgrade head`; `lastgood-service migrate` does the same).
"""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import create_engine, pool

from lastgood_service.catalog.models import Base, UTCDateTime

config = context.config
target_metadata = Base.metadata


def render_item(type_, obj, autogen_context):
    """Autogenerate writes our UTC type as the plain column type it stores."""
    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url") or os.environ.get("LASTGOOD_CATALOG_URL")
    if not url:
        raise RuntimeError("set LASTGOOD_CATALOG_URL to the catalog's SQLAlchemy URL")
    return url


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True,
                      render_as_batch=True, render_item=render_item)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = create_engine(_url(), poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata,
                          render_as_batch=True, render_item=render_item)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
