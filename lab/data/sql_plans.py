"""Questions of the procedural text-to-SQL worlds (`lab.data.sql_worlds`), sampled as plans and rendered twice.

A question is sampled as a *plan* — the SQL syntax tree at clause level (FROM, WHERE with an optional sub-query,
GROUP BY/HAVING, SELECT, ORDER BY/LIMIT, INTERSECT/EXCEPT) — and rendered twice: to SQL (`render_sql`: the clauses of
`render_clauses` joined in SQL's written order by `assemble`) and to templated English with synonyms (`render_nl`),
whose tokens carry their role (`Token.role`), so the gold alignment of question words to schema items is known.
`make_items` draws a schema's questions, each with its Spider hardness (`sql_worlds.hardness`).
"""

from __future__ import annotations

import random

from lab.data.sql_worlds import NUMERIC, TEXT, Item, Schema, Token, hardness, random_value

OPS = {">": ("more than", "above", "greater than", "over"), "<": ("less than", "below", "under", "smaller than"),
       "=": ("equal to", "exactly")}
AGG = {"AVG": ("average", "mean"), "MAX": ("maximum", "largest"), "MIN": ("minimum", "smallest")}


def _attrs(schema: Schema, t: str, kind=None) -> list[str]:
    return [k for k in schema.columns(t) if k not in ("id", "name") and not k.endswith("_id")
            and (kind is None or (k in NUMERIC) == (kind == "num"))]


def _cond(schema: Schema, t: str, rng: random.Random) -> tuple:
    col = rng.choice(_attrs(schema, t))
    op = rng.choice(("=",)) if col in TEXT else rng.choice((">", "<", ">", "<", "="))
    return (t, col, op, random_value(col, rng))


def sample_plan(schema: Schema, rng: random.Random) -> dict:
    """A random clause-level plan; the mix covers Spider's four hardness levels."""
    a, b, c, _ = (t for t, _ in schema.tables)
    t = rng.choice((a, b, c))
    others = [x for x in (a, b, c) if x != t]
    p = {"t": t, "sel": ("col", "name"), "where": [], "rel": None, "nest": None, "group": None, "having": None,
         "order": None, "setop": None}
    r = rng.random()
    if r < 0.15:
        p["sel"] = ("count",)
    elif r < 0.3:
        p["sel"] = ("agg", rng.choice(tuple(AGG)), rng.choice(_attrs(schema, t, "num")))
    elif r < 0.45 and _attrs(schema, t, "text"):
        p["sel"], p["group"] = ("group",), _attrs(schema, t, "text")[0]
        if rng.random() < 0.5:
            p["having"] = (rng.choice((">", "<")), rng.randint(1, 4))
    elif r < 0.65:
        p["sel"] = ("col", rng.choice(("name", "name", *_attrs(schema, t))))
    if rng.random() < 0.5:
        p["where"].append(_cond(schema, t, rng))
    if rng.random() < 0.45:
        p["rel"] = rng.choice(others)
        p["where"].append(_cond(schema, p["rel"], rng))
    if rng.random() < 0.3:
        if rng.random() < 0.5 and p["sel"][0] != "group":
            p["nest"] = ("above_avg", rng.choice(_attrs(schema, t, "num")))
        else:
            r2 = rng.choice([x for x in others if x != p["rel"]])
            p["nest"] = ("not_in", r2, _cond(schema, r2, rng) if rng.random() < 0.5 else None)
    if p["sel"][0] == "col" and p["group"] is None and rng.random() < 0.35:
        p["order"] = (rng.choice(_attrs(schema, t, "num")), rng.choice(("ASC", "DESC")),
                      rng.choice((None, rng.randint(2, 5))))
    if p["sel"][0] == "col" and not (p["rel"] or p["nest"] or p["order"]) and rng.random() < 0.3:
        p["setop"] = (rng.choice(("INTERSECT", "EXCEPT")), _cond(schema, t, rng))
    return p


def lit(v) -> str:
    return f"'{v}'" if isinstance(v, str) else str(v)


def join_clause(schema: Schema, tables: list[str]) -> str:
    """`FROM t0 JOIN ... ON ...` joining every table to the first along shortest FK paths."""
    out, have = [tables[0]], [tables[0]]
    for dst in tables[1:]:
        if dst in have:
            continue
        src = min(have, key=lambda s: len(schema.fk_path(s, dst)) or 99)
        node = src
        for e in schema.fk_path(src, dst):
            nxt = e[2] if e[0] == node else e[0]
            if nxt not in have:
                out.append(f"JOIN {nxt} ON {e[0]}.{e[1]} = {e[2]}.{e[3]}")
                have.append(nxt)
            node = nxt
    return "FROM " + " ".join(out)


def sub_not_in(schema: Schema, t: str, r: str, cond: tuple | None) -> tuple[str, str]:
    """`t.key NOT IN (SELECT ...)`: rows of t with no FK path to a row of r (satisfying `cond`)."""
    path = schema.fk_path(t, r)
    if not path:
        raise ValueError(f"no foreign-key path from {t} to {r}.")
    e = path[0]
    outer, inner = ((e[1], e[2] + "." + e[3]) if e[0] == t else (e[3], e[0] + "." + e[1]))
    first = e[2] if e[0] == t else e[0]
    tables = [first] + [x for x in (r,) if x != first]
    where = f" WHERE {cond[0]}.{cond[1]} {cond[2]} {lit(cond[3])}" if cond else ""
    return f"{t}.{outer}", f"SELECT {inner} {join_clause(schema, tables)}{where}"


def render_clauses(schema: Schema, p: dict) -> dict[str, str]:
    """The plan's SQL, one clause at a time (keys in syntax-tree order: from, where, group, select, order, setop)."""
    t = p["t"]
    q = lambda col: col if "." in col else f"{t}.{col}"  # a column of the main table, unless qualified
    sel = {"col": lambda s: q(s[1]), "count": lambda s: "COUNT(*)", "agg": lambda s: f"{s[1]}({q(s[2])})",
           "group": lambda s: f"{q(p['group'])}, COUNT(*)"}[p["sel"][0]](p["sel"])
    conds = [f"{c[0]}.{c[1]} {c[2]} {lit(c[3])}" for c in p["where"]]
    if p["nest"] and p["nest"][0] == "above_avg":
        col = q(p["nest"][1])
        conds.append(f"{col} > (SELECT AVG({col}) FROM {col.split('.')[0]})")
    elif p["nest"]:
        key, sub = sub_not_in(schema, t, p["nest"][1], p["nest"][2])
        conds.append(f"{key} NOT IN ({sub})")
    out = {"from": join_clause(schema, [t] + ([p["rel"]] if p["rel"] else []) + list(p.get("join", ()))),
           "where": "WHERE " + " AND ".join(conds) if conds else "",
           "group": f"GROUP BY {q(p['group'])}" if p["group"] else "", "select": f"SELECT {sel}", "order": "",
           "setop": ""}
    if p["having"]:
        out["group"] += f" HAVING COUNT(*) {p['having'][0]} {p['having'][1]}"
    if p["order"]:
        col, d, k = p["order"]
        out["order"] = f"ORDER BY {q(col)} {d}" + (f" LIMIT {k}" if k else "")
    if p["setop"]:
        kind, c = p["setop"]
        out["setop"] = f"{kind} SELECT {sel} {join_clause(schema, [t, c[0]])} WHERE {c[0]}.{c[1]} {c[2]} {lit(c[3])}"
    return out


ORDER = ("select", "from", "where", "group", "order", "setop")  # SQL's written order


def assemble(clauses: dict[str, str]) -> str:
    return " ".join(clauses[k] for k in ORDER if clauses.get(k))


def render_sql(schema: Schema, p: dict) -> str:
    return assemble(render_clauses(schema, p))


def render_nl(p: dict, rng: random.Random) -> list[Token]:
    """Templated English with synonyms; every schema word and value carries its role and plan slot."""
    t, out = p["t"], []
    T = lambda tab, slot, plural=True: Token(tab + ("s" if plural else ""), ("tab", tab), slot)
    C = lambda tab, col, slot: Token(col, ("col", tab, col), slot)
    V = lambda v, slot: Token(lit(v) if isinstance(v, str) else str(v), ("val", v), slot)
    W = lambda text: [Token(w) for w in text.split()]
    cond = lambda c, slot: ([C(c[0], c[1], slot)] + W(rng.choice(("is ", "")) + rng.choice(OPS[c[2]]))
                            + [V(c[3], slot + "v")])
    s = p["sel"]
    if s[0] == "count":
        out += W(rng.choice(("how many", "count the", "what is the number of"))) + [T(t, "t")]
    elif s[0] == "agg":
        out += W(f"what is the {rng.choice(AGG[s[1]])}") + [C(t, s[2], "sel")] + W("of") + [T(t, "t")]
    elif s[0] == "group":
        out += W("for each") + [C(t, p["group"], "sel")] + W(", how many") + [T(t, "t")]
    else:
        out += W(rng.choice(("what is the", "list the", "show the"))) + [C(t, s[1], "sel")] + W("of") + [T(t, "t")]
    for k, c in enumerate(p["where"]):
        if c[0] != t:
            out += W(rng.choice(("linked to a", "connected to some"))) + [T(c[0], "rel", False)]
        out += W(rng.choice(("whose", "with"))) + cond(c, f"w{k}")
    if p["nest"] and p["nest"][0] == "above_avg":
        out += W("whose") + [C(t, p["nest"][1], "nest")] + W(rng.choice(("is above the average", "exceeds the mean")))
    elif p["nest"]:
        out += W(rng.choice(("not linked to any", "that have no"))) + [T(p["nest"][1], "nest", False)]
        if p["nest"][2]:
            out += W("whose") + cond(p["nest"][2], "nc")
    if p["having"]:
        out += W(rng.choice(("keeping groups with", "only where the count is"))) + W(rng.choice(OPS[p["having"][0]]))
        out += [V(p["having"][1], "hv")]
    if p["order"]:
        col, d, k = p["order"]
        out += (W("keeping the top") + [V(k, "ov")] + W("by")) if k else W("sorted by")
        out += [C(t, col, "oc")] + W("descending" if d == "DESC" else "ascending")
    if p["setop"]:
        kind, c = p["setop"]
        out += W("and also" if kind == "INTERSECT" else "but not those") + W("whose") + cond(c, "sc")
    return out


def make_items(schema: Schema, n: int, rng: random.Random) -> list[Item]:
    items = []
    for _ in range(n):
        p = sample_plan(schema, rng)
        toks = render_nl(p, rng)
        sql = render_sql(schema, p)
        items.append(Item(schema.db_id, " ".join(x.word for x in toks) + "?", sql, p, toks, hardness(sql)))
    return items
