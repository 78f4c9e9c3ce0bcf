"""Alembic environment: runs the panel's migrations against the URL the panel gives it."""

from alembic import context
from sqlalchemy import engine_from_config, pool
from sqlmodel import SQLModel

from control_panel import models  # noqa: F401  (registers the tables on SQLModel.metadata)

config = context.config
with engine_from_config(
    config.get_section(config.config_ini_section, {}), prefix="sqlalchemy.", poolclass=pool.NullPool
).connect() as connection:
    context.configure(connection=connection, target_metadata=SQLModel.metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()
