"""Procedural SQLite databases and NL→SQL pairs for cross-domain text-to-SQL (the Spider setting, in miniature).

Twelve domains share one shape: entities A, B, C, a bridge AB (A–B many-to-many) and B.c_id → C, so the FK graph is
the chain A – AB – B – C. Every entity has `id` and `name` and two attributes from a shared pool, so column names
repeat across tables (`name` everywhere, `city`/`year`/`age` in several): a question about "the name" is ambiguous
until it is tied to a table. Each database is a real file (`build_db`) under a cache folder.

Questions (`Item`: the question, its SQL, its plan and its tokens with their roles) are sampled as clause-level
plans and rendered to SQL and English by `lab.data.sql_plans`. `hardness` is Spider's rule on component counts
(taoyds/spider `evaluation.py`, `eval_hardness`), computed on the sqlglot AST. Running queries, comparing results and
the Spider folder format are `lab.data.sql_exec`.
"""

from __future__ import annotations

import os
import random
import re
import sqlite3
import threading
from dataclasses import dataclass, field
from pathlib import Path

import sqlglot
from sqlglot import exp

# domain: (A, B, C, bridge AB)
DOMAINS = {
    "concerts": ("singer", "concert", "stadium", "performance"),
    "school": ("student", "course", "teacher", "enrollment"),
    "library": ("member", "book", "author", "loan"),
    "clinic": ("patient", "doctor", "hospital", "appointment"),
    "flights": ("passenger", "flight", "airline", "booking"),
    "shop": ("customer", "product", "supplier", "purchase"),
    "film": ("actor", "film", "studio", "casting"),
    "sports": ("player", "team", "league", "contract"),
    "museum": ("visitor", "exhibit", "gallery", "visit"),
    "hotel": ("guest", "hotel", "chain", "stay"),
    "company": ("employee", "project", "department", "assignment"),
    "music": ("listener", "album", "label", "review"),
}
NUMERIC = ("age", "year", "price", "rating", "capacity", "salary", "height", "score", "budget")
TEXT = ("city", "country")
CITIES = ("Paris", "Lima", "Oslo", "Cairo", "Delhi", "Tokyo", "Austin", "Porto")
COUNTRIES = ("France", "Peru", "Norway", "Egypt", "India", "Japan")


@dataclass(frozen=True)
class Schema:
    """Tables in listing order, their columns, and FK edges `(table, column, ref_table, ref_column)`."""

    db_id: str
    tables: tuple[tuple[str, tuple[str, ...]], ...]
    fks: tuple[tuple[str, str, str, str], ...]

    def columns(self, table: str) -> tuple[str, ...]:
        return dict(self.tables)[table]

    @property
    def table_names(self) -> list[str]:
        return [t for t, _ in self.tables]

    def fk_path(self, src: str, dst: str) -> list[tuple[str, str, str, str]]:
        """The FK edges of a shortest path src → dst (breadth first over the undirected FK graph); [] if none."""
        prev, frontier = {src: None}, [src]
        while frontier and dst not in prev:
            nxt = []
            for u in frontier:
                for e in self.fks:
                    for a, b in ((e[0], e[2]), (e[2], e[0])):
                        if a == u and b not in prev:
                            prev[b] = (u, e)
                            nxt.append(b)
            frontier = nxt
        if dst not in prev:
            return []
        path, node = [], dst
        while prev[node] is not None:
            node, e = prev[node]
            path.append(e)
        return path[::-1]


@dataclass(frozen=True)
class Token:
    word: str
    role: tuple = ()  # ("col", table, column) | ("tab", table) | ("val", value) | ()
    slot: str = ""  # the plan element it renders ("sel", "t", "w0", "w0v", "rel1", "nest", ...)


@dataclass
class Item:
    db_id: str
    question: str
    sql: str
    plan: dict
    tokens: list[Token] = field(default_factory=list)
    hardness: str = ""


def make_schema(domain: str) -> Schema:
    a, b, c, ab = DOMAINS[domain]
    rng = random.Random(sorted(DOMAINS).index(domain))
    nums = rng.sample(NUMERIC, 3)
    shared_text = rng.choice(TEXT)
    tables = ((a, ("id", "name", nums[0], shared_text)),
              (b, ("id", "name", nums[1], shared_text, f"{c}_id")),
              (c, ("id", "name", rng.choice(nums), "country" if shared_text == "city" else "city")),
              (ab, (f"{a}_id", f"{b}_id")))
    fks = ((ab, f"{a}_id", a, "id"), (ab, f"{b}_id", b, "id"), (b, f"{c}_id", c, "id"))
    return Schema(domain, tables, fks)


def random_value(col: str, rng: random.Random):
    """A random cell of column `col`: a city, a country, or an integer in the column's range."""
    if col == "city":
        return rng.choice(CITIES)
    if col == "country":
        return rng.choice(COUNTRIES)
    lo, hi = {"age": (18, 80), "year": (1990, 2024)}.get(col, (1, 100))
    return rng.randint(lo, hi)


def build_db(schema: Schema, folder: Path, seed: int, rows: tuple[int, int, int, int] = (40, 24, 8, 70)) -> Path:
    """Write `<folder>/<db_id>/<db_id>.sqlite` (Spider's layout) with random rows; returns its path. The file is
    written under a temporary name and renamed into place, so two processes building the same world at once (two
    notebook runs sharing the cache) never see, or write into, a half-built database."""
    rng = random.Random(f"{schema.db_id}:{seed}")
    path = Path(folder) / schema.db_id / f"{schema.db_id}.sqlite"
    path.parent.mkdir(parents=True, exist_ok=True)
    from lab.data.sql_exec import forget

    forget(path)  # a cached read-only connection to the file being replaced
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.unlink(missing_ok=True)
    con = sqlite3.connect(tmp)
    (a, _), (b, _), (c, _), (ab, _) = schema.tables
    for (t, cols), n in zip(schema.tables, rows, strict=True):
        refs = {e[1]: e[2] for e in schema.fks if e[0] == t}
        decl = [f"{k} {'INTEGER PRIMARY KEY' if k == 'id' else 'INTEGER' if k in refs or k in NUMERIC else 'TEXT'}"
                for k in cols] + [f"FOREIGN KEY ({k}) REFERENCES {r}(id)" for k, r in refs.items()]
        con.execute(f"CREATE TABLE {t} ({', '.join(decl)})")
        size = dict(zip((a, b, c), rows, strict=False))
        seen = set()
        for i in range(n):
            row = []
            for k in cols:
                row.append(i + 1 if k == "id" else f"{t}_{i + 1}" if k == "name"
                           else rng.randint(1, size[refs[k]]) if k in refs else random_value(k, rng))
            if t == ab and tuple(row) in seen:
                continue
            seen.add(tuple(row))
            con.execute(f"INSERT INTO {t} VALUES ({', '.join('?' * len(row))})", row)
    con.commit()
    con.close()
    os.replace(tmp, path)  # atomic: readers of the old file keep it until they close
    return path


# ------------------------------------------------------------------ evaluation

def tokenize(question: str) -> list[str]:
    """Words of a question: quoted values kept whole, numbers, lower-cased words, punctuation."""
    words = re.findall(r"'[^']*'|\d+(?:\.\d+)?|[A-Za-z_]+|[^\sA-Za-z0-9']", question)
    return [w if w.startswith("'") else w.lower() for w in words]


def hardness(sql: str) -> str:
    """Spider's hardness (`eval_hardness`): component counts on the sqlglot AST."""
    tree = sqlglot.parse_one(sql, read="sqlite")
    core = tree.this if isinstance(tree, (exp.Intersect, exp.Except, exp.Union)) else tree
    while isinstance(core, (exp.Intersect, exp.Except, exp.Union)):
        core = core.this
    where = core.args.get("where")
    comp1 = sum(bool(core.args.get(k)) for k in ("where", "group", "order", "limit"))
    comp1 += len(core.args.get("joins") or [])
    comp1 += len(list(where.find_all(exp.Or, exp.Like))) if where else 0
    nested = len([s for s in tree.find_all(exp.Select) if s is not tree and s is not core]) if tree is core else 0
    comp2 = len(list(tree.find_all(exp.Intersect, exp.Except, exp.Union))) + nested
    aggs = len(list(core.find_all(exp.AggFunc)))
    conds = len(list(where.this.find_all(exp.And))) + 1 if where else 0
    group = core.args.get("group")
    others = (aggs > 1) + (len(core.expressions) > 1) + (conds > 1) + (bool(group) and len(group.expressions) > 1)
    if comp1 <= 1 and others == 0 and comp2 == 0:
        return "easy"
    if (others <= 2 and comp1 <= 1 and comp2 == 0) or (comp1 <= 2 and others < 2 and comp2 == 0):
        return "medium"
    if ((others > 2 and comp1 <= 2 and comp2 == 0) or (2 < comp1 <= 3 and others <= 2 and comp2 == 0)
            or (comp1 <= 1 and others == 0 and comp2 <= 1)):
        return "hard"
    return "extra"
