"""Procedural SQLite worlds: schemas with FK chains and repeated names, gold SQL that runs, Spider's hardness rule on
hand-classified queries, execution match, failures as SQLFailure, and the Spider folder round trip."""

from __future__ import annotations

import random
import sqlite3

import pytest

from lab.data import sql_exec as sx
from lab.data import sql_plans as sp
from lab.data import sql_worlds as sw


@pytest.fixture(scope="module")
def concerts(tmp_path_factory):
    schema = sw.make_schema("concerts")
    return schema, sw.build_db(schema, tmp_path_factory.mktemp("db"), seed=0)


def test_schema_has_an_fk_chain_and_repeated_names(concerts):
    schema, db = concerts
    assert [len(p) for p in (schema.fk_path("singer", "stadium"), schema.fk_path("concert", "stadium"))] == [3, 1]
    names = [t for t, cols in schema.tables if "name" in cols]
    assert len(names) == 3
    con = sqlite3.connect(db)
    fks = con.execute("PRAGMA foreign_key_list('performance')").fetchall()
    assert {r[2] for r in fks} == {"singer", "concert"}
    assert sx.read_schema(db).tables == schema.tables and set(sx.read_schema(db).fks) == set(schema.fks)


def test_every_gold_query_runs_and_questions_align_with_their_tokens(concerts):
    schema, db = concerts
    items = sp.make_items(schema, 200, random.Random(0))
    nonempty = 0
    for it in items:
        nonempty += bool(sx.execute(db, it.sql))
        assert sw.tokenize(it.question)[:len(it.tokens)] == [t.word for t in it.tokens]
    assert nonempty > 120
    assert {it.hardness for it in items} == {"easy", "medium", "hard", "extra"}


@pytest.mark.parametrize("sql, level", [
    ("SELECT name FROM singer", "easy"),
    ("SELECT name FROM singer WHERE age > 20", "easy"),
    ("SELECT COUNT(*) FROM singer WHERE age > 20 AND city = 'Paris'", "medium"),
    ("SELECT singer.name FROM singer JOIN performance ON performance.singer_id = singer.id WHERE singer.age > 3",
     "medium"),
    ("SELECT name FROM singer WHERE id NOT IN (SELECT singer_id FROM performance)", "hard"),
    ("SELECT name FROM singer INTERSECT SELECT name FROM singer WHERE age > 3", "hard"),
    ("SELECT city, COUNT(*) FROM singer WHERE age > 3 GROUP BY city HAVING COUNT(*) > 2 ORDER BY city", "hard"),
    ("SELECT city FROM singer WHERE age > 3 GROUP BY city ORDER BY city LIMIT 3", "extra"),
    ("SELECT name FROM singer WHERE age > 3 AND id NOT IN (SELECT singer_id FROM performance) ORDER BY age",
     "extra"),
])
def test_hardness_follows_spiders_rule(sql, level):
    assert sw.hardness(sql) == level


def test_execution_match_is_a_multiset_unless_ordered():
    assert sx.same_result([(1,), (2,), (2,)], [(2,), (1,), (2,)], ordered=False)
    assert not sx.same_result([(1,), (2,)], [(2,), (1,)], ordered=True)
    assert not sx.same_result([(1,), (2,)], [(1,), (2,), (2,)], ordered=False)
    assert sx.same_result([(0.1 + 0.2,)], [(0.3,)], ordered=True)


def test_bad_sql_and_runaway_queries_are_failures_not_crashes(concerts):
    _, db = concerts
    with pytest.raises(sx.SQLFailure, match="no such column"):
        sx.execute(db, "SELECT nope FROM singer")
    with pytest.raises(sx.SQLFailure, match="timed out"):
        sx.execute(db, "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c",
                   timeout=0.2)
    with pytest.raises(sx.SQLFailure, match="does not exist"):
        sx.execute(db.parent / "missing.sqlite", "SELECT 1")


def test_spider_folder_round_trip(concerts, tmp_path):
    schema, db = concerts
    items = sp.make_items(schema, 5, random.Random(1))
    folder = sx.spider_folder(tmp_path / "spider", items, {"concerts": db})
    back, dbs = sx.load_spider(folder)
    assert [(b.question, b.sql, b.hardness) for b in back] == [(i.question, i.sql, i.hardness) for i in items]
    assert sx.execute(dbs["concerts"], back[0].sql) == sx.execute(db, items[0].sql)


def _build_many(folder: str) -> int:
    schema = sw.make_schema("concerts")
    for _ in range(15):
        sw.build_db(schema, folder, seed=0)
    return 0


def test_two_processes_building_the_same_world_at_once_neither_fail_nor_leave_a_partial_file(tmp_path):
    """Two notebook runs of one seed share the cache folder: each writes the world's databases. Built side by side,
    both must finish and the file must equal a database built alone (CI once hit `disk I/O error` here)."""
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(2) as pool:
        assert list(pool.map(_build_many, [str(tmp_path / "shared")] * 2)) == [0, 0]
    alone = sw.build_db(sw.make_schema("concerts"), tmp_path / "alone", seed=0)
    shared = tmp_path / "shared" / "concerts" / "concerts.sqlite"
    dump = lambda p: list(sqlite3.connect(p).iterdump())
    assert dump(shared) == dump(alone)
    assert [p.name for p in shared.parent.iterdir()] == ["concerts.sqlite"]
