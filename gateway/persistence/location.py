"""Where the database is: one resolver for `kvgate serve` and every command that opens the database.

A relative SQLite path is relative to the working directory of the process that opens it, so
`kvgate keys create` run in another directory than `kvgate serve` used to write to another file and
print a key the server rejected. The settings resolve the URL once (`resolve_database_url`, a
validator of `Settings.database_url`): a SQLite path becomes absolute, and a plain file path
(`/srv/kvgate.db`, `kvgate.db`) becomes the SQLite URL the user meant. `DatabaseLocation` is what a
command tells the user, and what it checks before it opens a SQLite file, since opening a missing
one creates it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import make_url
from sqlalchemy.exc import ArgumentError

SQLITE_DRIVER = "sqlite+aiosqlite"
# The first 16 bytes of every SQLite 3 database file (an empty file is an empty database too).
SQLITE_HEADER = b"SQLite format 3\x00"


def resolve_database_url(value: str) -> str:
    """The SQLAlchemy URL for `value`, a URL or a plain SQLite file path, with a SQLite file's path
    made absolute against the working directory. Raises ValueError, in one line, when `value` is
    neither."""
    value = value.strip()
    if not value:
        raise ValueError("empty database URL")
    if "://" not in value:
        return f"{SQLITE_DRIVER}:///{_absolute(value)}"
    try:
        url = make_url(value)
    except ArgumentError as exc:
        raise ValueError(f"{value!r} is neither a database URL nor a file path") from exc
    if url.get_backend_name() != "sqlite":
        return value
    resolved = url
    if url.drivername == "sqlite":  # the sync driver: kvgate opens databases with the async one
        resolved = resolved.set(drivername=SQLITE_DRIVER)
    if url.database and url.database != ":memory:" and not url.database.startswith("file:"):
        resolved = resolved.set(database=_absolute(url.database))
    return value if resolved == url else resolved.render_as_string(hide_password=False)


def _absolute(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))  # normalised (`..`), symlinks left as given


@dataclass(frozen=True, slots=True)
class DatabaseLocation:
    """A resolved database URL as a user reads it."""

    url: str
    # The SQLite file; None for a server database (PostgreSQL) or an in-memory SQLite one.
    path: Path | None

    @classmethod
    def of(cls, url: str) -> DatabaseLocation:
        parsed = make_url(url)
        database = parsed.database
        if parsed.get_backend_name() == "sqlite" and database and database != ":memory:" \
                and not database.startswith("file:"):
            return cls(url, Path(database))
        return cls(url, None)

    @property
    def shown(self) -> str:
        """The absolute file of a SQLite database, else the URL without its password."""
        if self.path is not None:
            return f"{self.path} (SQLite)"
        return make_url(self.url).render_as_string(hide_password=True)

    def problem(self, *, must_exist: bool) -> str | None:
        """Why this SQLite file cannot be opened as kvgate's database, in one line; None when it
        can (and always for a server database, whose errors come from its driver)."""
        path = self.path
        if path is None:
            return None
        if path.is_dir():
            return f"{path} is a directory, not a SQLite database file"
        if not path.exists():
            if must_exist:
                return (f"no database at {path} (start `kvgate serve` there first, or name the server's database "
                        "with --database-url or KVGATE_DATABASE_URL)")
            if not path.parent.is_dir():
                return f"no directory {path.parent} for the SQLite database {path.name}"
            return None
        if not os.access(path, os.R_OK):
            return f"cannot read {path}"
        with path.open("rb") as file:
            head = file.read(len(SQLITE_HEADER))
        if head and head != SQLITE_HEADER:
            return f"{path} is not a SQLite database"
        return None
