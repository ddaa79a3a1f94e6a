"""Running SQL on the procedural (or any Spider-format) SQLite databases of `lab.data.sql_worlds`, and reading and
writing the Spider folder format: `execute` (read-only, a timeout through a progress handler, every failure one
`SQLFailure` sentence) and `same_result` are execution accuracy (multisets; row order only under ORDER BY), as
taoyds/spider's `evaluation.py` compares results; `read_schema` recovers a database's tables and foreign keys;
`spider_folder` / `load_spider` write and read `database/<db>/<db>.sqlite` + a questions JSON (Spider's and BIRD's
layout).
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections import Counter
from pathlib import Path

from lab.data.sql_worlds import Item, Schema, hardness


class SQLFailure(RuntimeError):
    """A query that does not run (syntax, unknown column, timeout); its message is one sentence."""


_connections: dict[str, sqlite3.Connection] = {}


def forget(db: Path | str) -> None:
    """Close and drop the cached connection to `db` (before the file is rewritten)."""
    old = _connections.pop(str(db), None)
    if old is not None:
        old.close()


def execute(db: Path | str, sql: str, timeout: float = 2.0) -> list[tuple]:
    """Rows of `sql` on the database file (read-only, one cached connection per file); SQLFailure on an error or
    once `timeout` seconds have passed (a progress handler interrupts the query)."""
    key = str(db)
    if key not in _connections:
        if not Path(key).exists():
            raise SQLFailure(f"the database file {key} does not exist.")
        _connections[key] = sqlite3.connect(f"file:{key}?mode=ro", uri=True, check_same_thread=False)
    con = _connections[key]
    deadline = time.monotonic() + timeout
    con.set_progress_handler(lambda: int(time.monotonic() > deadline), 1000)
    try:
        return con.execute(sql).fetchall()
    except sqlite3.Error as e:
        reason = "timed out" if time.monotonic() > deadline else f"{type(e).__name__}: {e}"
        raise SQLFailure(f"the query failed ({reason}).") from None
    except (ValueError, OverflowError) as e:
        raise SQLFailure(f"the query failed ({type(e).__name__}: {e}).") from None


def _norm(rows: list[tuple]) -> list[tuple]:
    return [tuple(round(v, 4) if isinstance(v, float) else v for v in r) for r in rows]


def same_result(pred: list[tuple], gold: list[tuple], ordered: bool) -> bool:
    """Execution match: equal row lists under ORDER BY, equal multisets otherwise."""
    p, g = _norm(pred), _norm(gold)
    return p == g if ordered else Counter(p) == Counter(g)


def read_schema(db: Path | str) -> Schema:
    """A Schema from a SQLite file (tables, columns and foreign keys)."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        names = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table' ORDER BY rowid")]
        tables = tuple((t, tuple(r[1].lower() for r in con.execute(f"PRAGMA table_info('{t}')"))) for t in names)
        fks = tuple((t.lower(), r[3].lower(), r[2].lower(), (r[4] or "id").lower()) for t in names
                    for r in con.execute(f"PRAGMA foreign_key_list('{t}')"))
    finally:
        con.close()
    return Schema(Path(db).stem, tuple((t.lower(), c) for t, c in tables), fks)


def spider_folder(folder: Path, items: list[Item], dbs: dict[str, Path], name: str = "dev.json") -> Path:
    """Write `items` and their databases in Spider's layout: `database/<db>/<db>.sqlite` + `<name>`."""
    folder = Path(folder)
    for db_id, src in dbs.items():
        dst = folder / "database" / db_id / f"{db_id}.sqlite"
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(Path(src).read_bytes())
    rows = [{"db_id": it.db_id, "question": it.question, "query": it.sql} for it in items]
    (folder / name).write_text(json.dumps(rows, indent=1))
    return folder


def load_spider(folder: Path | str, limit: int | None = None) -> tuple[list[Item], dict[str, Path]]:
    """Questions (`dev.json`, else the first `*.json` with `db_id`/`question`/`query` or BIRD's `SQL`) and
    database files of a Spider- or BIRD-format folder."""
    folder = Path(folder)
    files = [folder / "dev.json"] if (folder / "dev.json").exists() else sorted(folder.glob("*.json"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no questions JSON (Spider's dev.json or BIRD's dev.json).")
    rows = json.loads(files[0].read_text())[:limit]
    dbs = {p.parent.name: p for p in sorted((folder / "database").glob("*/*.sqlite"))}
    if not dbs:
        dbs = {p.parent.name: p for p in sorted(folder.glob("*_databases/*/*.sqlite"))}
    items = []
    for r in rows:
        sql = r.get("query") or r.get("SQL") or ""
        if r["db_id"] in dbs:
            try:
                h = hardness(sql)
            except Exception:
                h = "extra"
            items.append(Item(r["db_id"], r["question"], sql, {}, [], h))
    return items, dbs
