"""Alembic environment: runs migrations against the URL the caller configured."""

from __future__ import annotations

from alembic import context
from sqlalchemy import engine_from_config, pool

from orchestrator.core.db import normalize_url, resolve_database_url
from orchestrator.core.models import Base
from orchestrator.core.settings import get_settings

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    if url:
        return url
    return resolve_database_url(get_settings())


def run_migrations_offline() -> None:
    context.configure(url=normalize_url(_url()), target_metadata=target_metadata)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    section = config.get_section(config.config_ini_section) or {}
    section["sqlalchemy.url"] = normalize_url(_url())
    connectable = engine_from_config(section, prefix="sqlalchemy.", poolclass=pool.NullPool)
    with connectable.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata)
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
