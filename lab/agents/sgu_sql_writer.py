"""SGU-SQL's offline clause writer: the `template` agent that stands in for the LLM in the toy (`lab.agents.
sgu_sql_study`), answering the same prompts an LLM gets.

**The offline writer (`ClauseWriter`, the `template` agent).** GPT-4 is replaced by a writer trained on the training
domains that answers the *same prompts* an LLM gets (it parses them back): it masks schema words and values in the
question (`COL0`, `TAB0`, `VAL0`), predicts a *skeleton* with linear SVMs (scikit-learn's `LinearSVC`) on TF-IDF
masked n-grams, and grounds every `COLi` to a column of the schema by name. Two limits are built in and are the
toy's assumptions:

- one shot (the direct prompt) it predicts the whole query's skeleton as one label, so a clause combination unseen
  in training cannot be written (its generalisation is by analogy to whole examples, like few-shot prompting);
  asked one clause at a time it predicts that clause's skeleton, so combinations compose;
- it grounds a column word by name only: among the columns of that name it prefers those in `Schema_links`, then
  those of the tables already in the partial SQL's FROM (else the tables the question names), then the first listed
  — so an ambiguous `name` is resolved only by the links or by a FROM clause written first.
"""

from __future__ import annotations

import copy
import functools
import re
from collections import Counter

from lab.agents import sgu_sql as sg
from lab.core.stages import key_of, stage
from lab.data import sql_plans as sp
from lab.data import sql_worlds as sw

# ------------------------------------------------------------------ masking, skeleton labels, grounding

def mask(words: list[str], schema: sw.Schema) -> tuple[list[str], dict[str, list[str]]]:
    """Schema words → TABi / COLi, values → VALi (numbered by order of mention)."""
    return _mask(tuple(words), schema)


@functools.lru_cache(maxsize=20_000)
def _mask(words: tuple[str, ...], schema: sw.Schema) -> tuple[list[str], dict[str, list[str]]]:
    tabs = schema.table_names
    cols = {c for _, cs in schema.tables for c in cs if c != "id" and not c.endswith("_id")}
    out, mentions = [], {"TAB": [], "COL": [], "VAL": []}
    for w in words:
        kind = ("TAB" if any(sg.matches(w, t) for t in tabs) else "COL" if any(sg.matches(w, c) for c in cols)
                else "VAL" if w[0] == "'" or w[0].isdigit() else "")
        if kind:
            out.append(f"{kind}{len(mentions[kind])}")
            mentions[kind].append(w)
        else:
            out.append(w)
    return out, mentions


def skeleton(item: sw.Item) -> dict[str, str]:
    """The gold skeleton of each clause, over mention indices (from the tokens' plan slots)."""
    idx, count = {}, Counter()
    for t in item.tokens:
        if t.role:
            kind = {"tab": "TAB", "col": "COL", "val": "VAL"}[t.role[0]]
            idx.setdefault(t.slot, f"{kind}{count[kind]}")
            count[kind] += 1
    p = item.plan
    conds = [f"{idx[f'w{k}']} {c[2]} {idx[f'w{k}v']}" for k, c in enumerate(p["where"])]
    if p["nest"] and p["nest"][0] == "above_avg":
        conds.append(f"AVG {idx['nest']}")
    elif p["nest"]:
        conds.append(f"NOTIN {idx['nest']}" + (f" {idx['nc']} {p['nest'][2][2]} {idx['ncv']}" if p["nest"][2] else ""))
    s = p["sel"]
    sel = (idx["sel"] if s[0] == "col" else "COUNT" if s[0] == "count" else f"{s[1]} {idx['sel']}" if s[0] == "agg"
           else f"GROUP {idx['sel']}")
    group = "none" if not p["group"] else idx["sel"] + (f" HAVING {p['having'][0]} {idx['hv']}" if p["having"] else "")
    order = "none" if not p["order"] else (f"{idx['oc']} {p['order'][1]}" + (" LIMIT " + idx["ov"] if p["order"][2]
                                                                                  else ""))
    setop = "none" if not p["setop"] else f"{p['setop'][0]} {idx['sc']} {p['setop'][1][2]} {idx['scv']}"
    return {"from": idx["t"] + (f" {idx['rel']}" if p["rel"] else ""), "where": " AND ".join(conds) or "none",
            "group": group, "select": sel, "order": order, "setop": setop}


def ground_col(word: str, schema: sw.Schema, linked: set[str], context: list[str]) -> str:
    """`t.c` for a column word: linked columns first, then the context tables', then the first listed."""
    cands = [f"{t}.{c}" for t, cs in schema.tables for c in cs if sg.matches(word, c)]
    for keep in (lambda x: x in linked, lambda x: x.split(".")[0] in context):
        narrowed = [x for x in cands if keep(x)]
        cands = narrowed or cands
    return cands[0] if cands else f"{schema.table_names[0]}.{word}"


def ground_tab(word: str, schema: sw.Schema) -> str:
    return next((t for t in schema.table_names if sg.matches(word, t)), schema.table_names[0])


def decode(labels: dict[str, str], mentions: dict, schema: sw.Schema, linked: set[str], context: list[str],
           main: str | None = None) -> dict:
    """Skeleton labels + grounding → a plan `sp.render_clauses` renders."""
    get = lambda ref, i=0: mentions[ref[:3]][int(ref[3:])] if int(ref[3:]) < len(mentions[ref[:3]]) else "0"
    val = lambda ref: (lambda w: w.strip("'") if w.startswith("'") else int(float(w)))(get(ref))
    col = lambda ref, ctx=context: ground_col(get(ref), schema, linked, ctx)
    f = labels.get("from", "TAB0").split()
    t = main or ground_tab(get(f[0]), schema)
    p = {"t": t, "sel": ("count",), "where": [], "rel": ground_tab(get(f[1]), schema) if len(f) > 1 else None,
         "nest": None, "group": None, "having": None, "order": None, "setop": None, "join": []}
    cond = lambda c, op, v, ctx=context: (*col(c, ctx).split("."), op, val(v))
    for part in labels.get("where", "none").split(" AND "):
        w = part.split()
        if w[0] == "AVG":
            p["nest"] = ("above_avg", col(w[1]))
        elif w[0] == "NOTIN":
            r = ground_tab(get(w[1]), schema)
            path = [x for e in schema.fk_path(t, r) for x in (e[0], e[2]) if x != t]
            p["nest"] = ("not_in", r, cond(*w[2:5], ctx=path) if len(w) >= 5 else None)
        elif len(w) == 3:
            p["where"].append(cond(*w))
    s = labels.get("select", "COUNT").split()
    p["sel"] = (("count",) if s[0] == "COUNT" else ("group",) if s[0] == "GROUP" else ("col", col(s[0]))
                if len(s) == 1 else ("agg", s[0], col(s[1])))
    g = labels.get("group", "none").split()
    if g[0] != "none" or s[0] == "GROUP":
        p["group"] = col(g[0] if g[0] != "none" else s[1])
        p["having"] = (g[2], val(g[3])) if len(g) >= 4 else None
    o = labels.get("order", "none").split()
    if o[0] != "none":
        p["order"] = (col(o[0]), o[1], val(o[3]) if len(o) >= 4 else None)
    z = labels.get("setop", "none").split()
    if z[0] != "none":
        p["setop"] = (z[0], cond(*z[1:4]))
    used = {c[0] for c in p["where"]} | {x.split(".")[0] for x in (p["group"] or "",) if "." in x}
    p["join"] = sorted(used - {t, p["rel"]})
    return p


# ------------------------------------------------------------------ the offline writer

def parse_prompt(text: str) -> dict[str, str]:
    return {m.group(1).lower(): m.group(2).strip() for m in re.finditer(r"### (\w+)\n(.*?)(?=\n\n|\Z)", text, re.S)}


@functools.lru_cache(maxsize=1000)
def parse_schema(text: str) -> sw.Schema:
    lines = text.splitlines()
    tables = tuple((m.group(1), tuple(c.strip() for c in m.group(2).split(",")))
                   for m in (re.match(r"(\w+)\((.*)\)", x) for x in lines) if m)
    fks = tuple((a, x, b, y) for a, x, b, y in re.findall(r"(\w+)\.(\w+) = (\w+)\.(\w+)", lines[-1]))
    return sw.Schema("prompt", tables, fks)


class ClauseWriter:
    """The offline LLM stand-in: skeleton classifiers (one per clause, and one for the whole query) + grounding."""

    def __init__(self, items: list[sw.Item], schemas: dict[str, sw.Schema], C: float = 1.0):
        from sklearn.feature_extraction.text import TfidfVectorizer
        from sklearn.svm import LinearSVC

        texts = [" ".join(mask(sw.tokenize(it.question), schemas[it.db_id])[0]) for it in items]
        labels = [skeleton(it) for it in items]
        self._key = key_of(texts, labels, C)
        self.vec = TfidfVectorizer(token_pattern=r"\S+", ngram_range=(1, 3), lowercase=False, min_df=2)
        X = self.vec.fit_transform(texts)
        fit = lambda y: LinearSVC(C=C).fit(X, y) if len(set(y)) > 1 else _Const(y[0])
        self.clause = {c: fit([lab[c] for lab in labels]) for c in sg.SYNTAX_ORDER}
        self.whole = fit([" | ".join(lab[c] for c in sg.SYNTAX_ORDER) for lab in labels])
        self.memo: dict[tuple[str, str], str] = {}
        self.from_whole = False  # True in the view `whole_query_clauses` returns

    def _predict(self, masked: str, clause: str) -> str:
        if (masked, clause) not in self.memo:
            model = self.whole if clause == "query" else self.clause[clause]
            self.memo[masked, clause] = str(model.predict(self.vec.transform([masked]))[0])
        return self.memo[masked, clause]

    def __stage_key__(self) -> str | tuple:  # what it was trained on (its answer memo is not part of its identity)
        return (self._key, "whole_query_clauses") if getattr(self, "from_whole", False) else self._key

    def whole_query_clauses(self) -> ClauseWriter:
        """A view of this writer that answers a clause prompt with that clause of its whole-query skeleton prediction
        (the `whole_query_clauses` control): decomposition's steps without per-clause predictions."""
        view = copy.copy(self)
        view.from_whole, view.memo = True, {}
        return view

    def prime(self, masked: list[str]) -> None:
        """Predict every clause (and the whole query) for many masked questions at once (the memo answers later)."""
        X = self.vec.transform(masked)
        for c, model in [*self.clause.items(), ("query", self.whole)]:
            self.memo.update({(m, c): str(y) for m, y in zip(masked, model.predict(X), strict=True)})

    def labels(self, masked: str, clause: str) -> dict[str, str]:
        if clause == "query" or getattr(self, "from_whole", False):  # (a writer cached before the flag has none)
            return dict(zip(sg.SYNTAX_ORDER, self._predict(masked, "query").split(" | "), strict=True))
        return {c: self._predict(masked, c) for c in sg.SYNTAX_ORDER}

    def __call__(self, msgs: list[dict]) -> str:
        sec = parse_prompt(msgs[-1]["content"])
        schema = parse_schema(sec["schema"])
        linked = set(re.findall(r"(\w+\.\w+)", sec.get("schema_links", "")))
        masked, mentions = mask(sw.tokenize(sec["question"]), schema)
        named = [ground_tab(w, schema) for w in mentions["TAB"]]
        clause = sec.get("clause", "").lower() or "query"
        labels = self.labels(" ".join(masked), clause)
        outer = re.sub(r"\(.*\)", "", sec.get("partial_sql", ""))  # the main query, sub-queries removed
        m = re.search(r"\bFROM (\w+)(.*?)(?= WHERE | GROUP | ORDER | INTERSECT | EXCEPT |$)", outer)
        main, context = (m.group(1), re.findall(r"(?:FROM|JOIN) (\w+)", m.group(0))) if m else (None, named)
        try:  # a skeleton that does not fit this schema is an unwritable answer, as an LLM's would be
            plan = decode(labels, mentions, schema, linked, context, main)
            if clause == "query":
                return sp.render_sql(schema, plan)
            return sp.render_clauses(schema, plan)[clause] or "NONE"
        except (IndexError, KeyError, ValueError):
            return "NONE"


class _Const:
    def __init__(self, y):
        self.y = y

    def predict(self, X):
        return [self.y] * X.shape[0]


@stage
def train_writer(items: list[sw.Item], schemas: dict, C: float) -> ClauseWriter:
    return ClauseWriter(items, schemas, C)
