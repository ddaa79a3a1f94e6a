"""SGU-SQL (Zhang et al., "Structure-Guided Large Language Models for Text-to-SQL Generation", ICML 2025,
arXiv 2402.13284; official code Qing145/Text-to-SQL): structure-aware linking over a question graph and a database
graph, then syntax-tree-guided generation, one clause at a time, through any `lab.agents.backends` backend.

**What is re-implemented, and from where.** The paper (§3.1–3.2) builds a query graph (question words, adjacency
and dependency edges) and a database graph (tables, columns; table-has-column and PK/FK edges), encodes both with a
relation-aware graph attention network (RGAT) and matches query nodes to schema nodes, giving a linked, pruned
schema subgraph; §3.3 decomposes generation along the SQL syntax tree into per-clause sub-tasks that the LLM solves
incrementally. The official release has **no graph linker** (its linking is a GPT-4 chain-of-thought prompt and
its decomposition a query-plan → sub-question prompt), so the linker here follows the paper's description:

- `question_graph` / `schema_graph`: the two graphs and the cross-graph exact-match relations (RAT-SQL's
  name-based linking relations) in one relation matrix; dependency edges come from a rule parser ("X of Y",
  "Y whose|with X"), since the toy has no dependency parser.
- `DualGraphLinker` (`lab.agents.sgu_sql_linker`, with its training): 2 relation-aware attention layers
  (per-relation key and value vectors, RAT-SQL/RGAT style) over the joint graph; a pair head scores every (question
  word, same-named schema column) candidate from the two node states and the pair's relation paths in the joint
  graph (`pair_features`: word –dependency– table word –match– the column's table; the nearest table words), and a
  node head every table. Training loss: BCE on "this word refers to that column" and "this table is used" — an
  assumption (the paper's loss is not stated), labelled as such in the notebook.
- `link`: the linked subgraph — columns whose pair probability > 0.5, tables above 0.5 and the tables of linked
  columns, completed by shortest FK paths (bridge tables and join keys), listed in the release's
  `Schema_links: [t.c, t1.c = t2.c, ...]` format.
- `generate`: the direct baseline (one prompt, whole query) and SGU's syntax-tree order — FROM/JOIN skeleton →
  WHERE (its sub-query inside) → GROUP BY/HAVING → SELECT → ORDER BY/LIMIT → set operation — each sub-task seeing
  the question, the schema, the links, the clause asked and the partial SQL; answers are assembled in SQL's
  written order and validated with sqlglot. Any failure (unreachable endpoint, unparseable reply) is a recorded
  failure of that item, never an exception.
"""

from __future__ import annotations

import functools
import random
import re
from collections import Counter
from dataclasses import dataclass

import numpy as np
import sqlglot
import torch

from lab.agents.backends import BackendError
from lab.data import sql_plans as sp
from lab.data import sql_worlds as sw

REL = ("none", "self", "q-adj", "q-dep", "has-col", "col-of", "fk-col", "fk-tab", "match", "matched-by")
R = {r: i for i, r in enumerate(REL)}
SYNTAX_ORDER = ("from", "where", "group", "select", "order", "setop")


@functools.lru_cache(maxsize=50_000)
def parse(sql: str) -> sqlglot.exp.Expression:
    """sqlglot's AST of a SQLite query (memoised: arms often write the same query; never mutate the result)."""
    return sqlglot.parse_one(sql, read="sqlite")


def matches(word: str, name: str) -> bool:
    """A question word names a schema item: equal, or the item's plural."""
    return word == name or word == name + "s"


def dependencies(words: list[str]) -> list[tuple[int, int]]:
    """Rule dependency edges: "X of [the|all|each] Y" → (X, Y); "Y whose|with X" → (Y, X)."""
    skip = {"the", "all", "each", "a", "some", "any"}
    edges = []
    for i, w in enumerate(words):
        if w in ("of", "whose", "with") and 0 < i < len(words) - 1:
            j = i + 1
            while j < len(words) - 1 and words[j] in skip:
                j += 1
            edges.append((i - 1, j))
    return edges


@dataclass
class Graph:
    """The joint graph of one question and one schema: node ids, relation matrix, candidate pairs."""

    words: list[str]
    nodes: list[tuple]  # ("tok", i) | ("tab", t) | ("col", t, c)
    rel: torch.Tensor  # (N, N) relation ids
    word_ids: torch.Tensor  # (N,) vocabulary id of the node's word (tokens, columns); 0 = unknown
    kind: torch.Tensor  # (N,) 0 token, 1 table, 2 column
    pairs: list[tuple[int, int]]  # (token node, column node) exact matches — the linking candidates
    tables: list[int]  # table node ids
    pair_feats: torch.Tensor | None = None  # (n_pairs, N_PAIR_FEATS) relation-path features


def col_word(c: str) -> str:
    return "<fk>" if c.endswith("_id") else c


def build_graph(words: list[str], schema: sw.Schema, vocab: dict[str, int]) -> Graph:
    """Question graph (adjacency, dependency) + database graph (has-column, FK) + cross exact-match edges."""
    nodes = [("tok", i) for i in range(len(words))]
    nodes += [("tab", t) for t in schema.table_names]
    nodes += [("col", t, c) for t, cols in schema.tables for c in cols]
    idx = {n: k for k, n in enumerate(nodes)}
    rel = np.zeros((len(nodes), len(nodes)), dtype=np.int64)
    np.fill_diagonal(rel, R["self"])
    for i in range(len(words) - 1):
        rel[i, i + 1] = rel[i + 1, i] = R["q-adj"]
    for i, j in dependencies(words):
        rel[i, j] = rel[j, i] = R["q-dep"]
    for t, cols in schema.tables:
        for c in cols:
            rel[idx["tab", t], idx["col", t, c]], rel[idx["col", t, c], idx["tab", t]] = R["has-col"], R["col-of"]
    for a, ca, b, cb in schema.fks:
        rel[idx["col", a, ca], idx["col", b, cb]] = rel[idx["col", b, cb], idx["col", a, ca]] = R["fk-col"]
        rel[idx["tab", a], idx["tab", b]] = rel[idx["tab", b], idx["tab", a]] = R["fk-tab"]
    pairs = []
    named = [(k, n) for k, n in enumerate(nodes) if n[0] != "tok" and n[-1] != "id" and not n[-1].endswith("_id")]
    for i, w in enumerate(words):
        for k, n in named:
            if matches(w, n[-1]):
                rel[i, k], rel[k, i] = R["match"], R["matched-by"]
                if n[0] == "col":
                    pairs.append((i, k))
    word_ids = torch.tensor([vocab.get(words[n[1]] if n[0] == "tok" else col_word(n[-1]) if n[0] == "col" else "",
                                       0) for n in nodes])
    kind = torch.tensor([{"tok": 0, "tab": 1, "col": 2}[n[0]] for n in nodes])
    return Graph(words, nodes, torch.from_numpy(rel), word_ids, kind, pairs,
                 [idx["tab", t] for t in schema.table_names], pair_features(rel, len(words), nodes, pairs))


N_PAIR_FEATS = 5


def pair_features(rel: np.ndarray, n_words: int, nodes: list[tuple], pairs: list[tuple[int, int]]) -> torch.Tensor:
    """Relation paths of the joint graph from word i to column j's table t: i –dep– k –match– t; t matched by the
    first table word of the question, by the nearest table word before i, after i; 1 / #columns word i matches."""
    tab_of = {k: n[1] for k, n in enumerate(nodes) if n[0] == "tab"}
    matched = {i: tab_of[k] for i in range(n_words) for k in tab_of if rel[i, k] == R["match"]}
    order = sorted(matched)
    deps = {i: {int(k) for k in np.flatnonzero(rel[i, :n_words] == R["q-dep"])} for i, _ in pairs}
    n_c = Counter(i for i, _ in pairs)
    feats = []
    for i, j in pairs:
        t = nodes[j][1]
        before = [k for k in order if k < i]
        after = [k for k in order if k > i]
        feats.append([float(any(matched.get(k) == t for k in deps[i])), float(bool(order) and matched[order[0]] == t),
                      float(bool(before) and matched[before[-1]] == t), float(bool(after) and matched[after[0]] == t),
                      1.0 / n_c[i]])
    return torch.tensor(feats, dtype=torch.float).reshape(-1, N_PAIR_FEATS)


def link(g: Graph, schema: sw.Schema, probs: tuple[list[float], list[float]], threshold: float = 0.5) -> dict:
    """The linked subgraph: columns (per question word, the best match above threshold), tables, FK-path joins."""
    best: dict[int, tuple[float, tuple]] = {}
    for (i, j), p in zip(g.pairs, probs[0], strict=True):
        if p > threshold and p > best.get(i, (0.0,))[0]:
            best[i] = (p, g.nodes[j][1:])
    cols = list(dict.fromkeys(c for _, c in best.values()))
    tables = [g.nodes[k][1] for k, p in zip(g.tables, probs[1], strict=True) if p > threshold]
    return complete_links(schema, cols, tables)


def complete_links(schema: sw.Schema, cols: list[tuple], tables: list[str]) -> dict:
    """Add the tables of linked columns and join every linked table to the first by shortest FK paths."""
    tables = list(dict.fromkeys([*tables, *(t for t, _ in cols)]))
    joins = []
    for t in tables[1:]:
        for e in schema.fk_path(tables[0], t):
            if e not in joins:
                joins.append(e)
    tables = list(dict.fromkeys([*tables, *(x for e in joins for x in (e[0], e[2]))]))
    return {"columns": cols, "tables": tables, "joins": joins}


def oracle_links(item: sw.Item, schema: sw.Schema) -> dict:
    cols = [tuple(t.role[1:]) for t in item.tokens if t.role[:1] == ("col",)]
    tabs = [t.role[1] for t in item.tokens if t.role[:1] == ("tab",)]
    return complete_links(schema, list(dict.fromkeys(cols)), list(dict.fromkeys(tabs)))


def links_text(links: dict) -> str:
    items = [f"{t}.{c}" for t, c in links["columns"]] + [f"{a}.{x} = {b}.{y}" for a, x, b, y in links["joins"]]
    items += [t for t in links["tables"] if not any(i.startswith(t + ".") for i in items)]
    return "[" + ", ".join(items) + "]"


# ------------------------------------------------------------------ prompts and the generation loop

SYSTEM = "You are an expert SQLite programmer. Answer with SQL only, no explanation."
CLAUSE_HINT = {"from": "the FROM clause with its JOINs", "where": "the WHERE clause (with any sub-query), or NONE",
               "group": "the GROUP BY clause with any HAVING, or NONE", "select": "the SELECT clause",
               "order": "the ORDER BY clause with any LIMIT, or NONE",
               "setop": "an INTERSECT/EXCEPT branch (e.g. INTERSECT SELECT ...), or NONE"}


def schema_text(schema: sw.Schema) -> str:
    lines = [f"{t}({', '.join(cols)})" for t, cols in schema.tables]
    return "\n".join(lines + ["Foreign keys: " + ", ".join(f"{a}.{x} = {b}.{y}" for a, x, b, y in schema.fks)])


def messages(schema: sw.Schema, question: str, links: dict | None, clause: str | None = None,
             partial: str = "") -> list[dict]:
    """The release's prompt sections: schema, `Schema_links`, question; SGU adds the clause asked and partial SQL."""
    parts = [f"### Schema\n{schema_text(schema)}"]
    if links is not None:
        parts.append(f"### Schema_links\n{links_text(links)}")
    parts.append(f"### Question\n{question}")
    if clause:
        parts += [f"### Clause\n{clause.upper()}", f"### Partial SQL\n{partial or '(empty)'}",
                  f"Write only {CLAUSE_HINT[clause]}."]
    else:
        parts.append("Write the SQL query.")
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "\n\n".join(parts)}]


def clean(reply: str) -> str:
    """Strip code fences, a trailing ';' and NONE; keep the first statement."""
    text = re.sub(r"```(?:sql)?", "", reply, flags=re.I).strip()
    text = text.split(";")[0].strip()
    return "" if text.upper() in ("NONE", "") else " ".join(text.split())


def generate(backend, schema: sw.Schema, question: str, links: dict | None, mode: str = "sgu",
             rng: random.Random | None = None) -> dict:
    """One question → `{"sql", "steps": [(clause, partial SQL)], "error"}`. `mode`: "direct" (one prompt),
    "sgu" (syntax-tree order), "random" (the same sub-tasks in a random order, `rng`)."""
    steps, error = [], ""
    try:
        if mode == "direct":
            sql = clean(backend.complete(messages(schema, question, links), max_tokens=192))
            steps.append(("query", sql))
        else:
            order = list(SYNTAX_ORDER)
            if mode == "random":
                (rng or random.Random(0)).shuffle(order)
            got: dict[str, str] = {}
            for clause in order:
                partial = sp.assemble(got)
                got[clause] = clean(backend.complete(messages(schema, question, links, clause, partial),
                                                     max_tokens=96))
                steps.append((clause, sp.assemble(got)))
            sql = sp.assemble(got)
        parse(sql)
    except BackendError as e:
        sql, error = "", str(e)
    except (RuntimeError, ValueError, IndexError) as e:  # a local model that cannot answer this prompt
        sql, error = "", f"the backend failed on this prompt ({type(e).__name__}: {str(e)[:120]})."
    except sqlglot.errors.SqlglotError as e:
        error = f"the SQL does not parse ({type(e).__name__})."
    return {"sql": sql, "steps": steps, "error": error}
