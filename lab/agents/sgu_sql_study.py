"""The SGU-SQL toy: procedural databases split by domain, the trained linker, an offline clause writer standing in
for the LLM, and the arms the paper compares (`lab.agents.sgu_sql` holds the method).

**The offline writer (`ClauseWriter`, the `template` agent).** GPT-4 is replaced by a writer trained on the training
domains that answers the *same prompts* an LLM gets (it parses them back): it masks schema words and values in the
question (`COL0`, `TAB0`, `VAL0`), predicts a *skeleton* with logistic regression on masked n-grams (scikit-learn),
and grounds every `COLi` to a column of the schema by name. Two limits are built in and are the toy's assumptions:

- one shot (the direct prompt) it predicts the whole query's skeleton as one label, so a clause combination unseen
  in training cannot be written (its generalisation is by analogy to whole examples, like few-shot prompting);
  asked one clause at a time it predicts that clause's skeleton, so combinations compose;
- it grounds a column word by name only: among the columns of that name it prefers those in `Schema_links`, then
  those of the tables already in the partial SQL's FROM (else the tables the question names), then the first listed
  — so an ambiguous `name` is resolved only by the links or by a FROM clause written first.

Everything that differs between the arms is therefore what the paper varies: the links shown (none, the dual-graph
linker's, the gold ones) and how generation is decomposed (one prompt, syntax-tree order, random order).
"""

from __future__ import annotations

import functools
import random
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

import sqlglot
from sqlglot import exp

from lab.agents import sgu_sql as sg
from lab.agents.backends import Offline
from lab.core.stages import key_of, stage
from lab.data import sql_worlds as sw

ARMS = ("direct", "direct+linker", "sgu", "no_linker", "random_order", "oracle")
HARD = ("hard", "extra")


@dataclass(frozen=True)
class Config:
    n_train_domains: int = 8
    per_domain_train: int = 150
    per_domain_test: int = 100
    linker_steps: int = 100
    linker_batch: int = 32
    linker_lr: float = 3e-3
    d: int = 32
    C: float = 1.0  # inverse L2 strength of the skeleton classifiers (linear SVMs on tf-idf of masked 1–3-grams)
    n_llm: int = 3  # held-out questions asked of an LLM backend (two arms, up to 7 prompts each)
    n_folder: int = 200  # questions read from a Spider/BIRD-format folder
    control: str = ""

    @classmethod
    def for_scale(cls, scale: str, control: str = "", **kw) -> Config:
        base = cls(control=control) if scale == "smoke" else cls(per_domain_train=800, per_domain_test=300,
                                                                linker_steps=600, n_llm=100, control=control)
        return replace(base, **kw)


@dataclass
class World:
    schemas: dict[str, sw.Schema]
    dbs: dict[str, Path]
    train: list[sw.Item]
    test: list[sw.Item]
    train_domains: list[str]
    test_domains: list[str]
    key: tuple = ()  # what it was built from (config, seed or folder): its identity for the stage cache

    def __stage_key__(self) -> tuple:
        return self.key or (sorted(self.dbs), [it.sql for it in self.test], [it.question for it in self.train])


@stage
def questions(cfg: Config, seed: int) -> tuple[list[sw.Item], list[sw.Item], list[str], list[str]]:
    """Domains split train/held-out by `seed`; NL→SQL pairs per domain (train, test, their domains)."""
    rng = random.Random(seed)
    names = sorted(sw.DOMAINS)
    rng.shuffle(names)
    tr, te = names[:cfg.n_train_domains], names[cfg.n_train_domains:]
    make = lambda d, n, tag: sw.make_items(sw.make_schema(d), n, random.Random(f"{seed}:{d}:{tag}"))
    return ([it for d in tr for it in make(d, cfg.per_domain_train, "train")],
            [it for d in te for it in make(d, cfg.per_domain_test, "test")], tr, te)


def build_world(cfg: Config, seed: int, folder: Path | None = None) -> World:
    """The twelve databases written under `folder` (default: the lab cache) and the questions."""
    from lab.models.train import cache_dir

    folder = Path(folder or cache_dir() / "sql_worlds" / f"seed{seed}")
    schemas = {d: sw.make_schema(d) for d in sorted(sw.DOMAINS)}
    dbs = {d: sw.build_db(s, folder, seed) for d, s in schemas.items()}
    train, test, tr, te = questions(replace(cfg, control=""), seed)
    return World(schemas, dbs, train, test, tr, te, ("procedural", replace(cfg, control=""), seed, str(folder)))


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
    """Skeleton labels + grounding → a plan `sw.render_clauses` renders."""
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

    def _predict(self, masked: str, clause: str) -> str:
        if (masked, clause) not in self.memo:
            model = self.whole if clause == "query" else self.clause[clause]
            self.memo[masked, clause] = str(model.predict(self.vec.transform([masked]))[0])
        return self.memo[masked, clause]

    def __stage_key__(self) -> str:  # what it was trained on (its answer memo is not part of its identity)
        return self._key

    def prime(self, masked: list[str]) -> None:
        """Predict every clause (and the whole query) for many masked questions at once (the memo answers later)."""
        X = self.vec.transform(masked)
        for c, model in [*self.clause.items(), ("query", self.whole)]:
            self.memo.update({(m, c): str(y) for m, y in zip(masked, model.predict(X), strict=True)})

    def labels(self, masked: str, clause: str) -> dict[str, str]:
        if clause == "query":
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
                return sw.render_sql(schema, plan)
            return sw.render_clauses(schema, plan)[clause] or "NONE"
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


# ------------------------------------------------------------------ the linker, evaluation, arms

def vocab_of(train: list[sw.Item], schemas: dict, domains: list[str]) -> dict[str, int]:
    """Words seen in at least two training domains (+ column words); everything else is unknown (id 0)."""
    seen = defaultdict(set)
    for it in train:
        for w in sw.tokenize(it.question):
            seen[w].add(it.db_id)
    words = {w for w, d in seen.items() if len(d) >= 2}
    words |= {sg.col_word(c) for d in domains for _, cs in schemas[d].tables for c in cs}
    return {w: i + 1 for i, w in enumerate(sorted(words))}


def train_linker(world: World, cfg: Config, seed: int):
    """The dual-graph linker trained on the training domains' questions, and its vocabulary."""
    return _train_linker(world.train, world.schemas, world.train_domains, replace(cfg, control=""), seed)


@stage
def _train_linker(train: list[sw.Item], schemas: dict, domains: list[str], cfg: Config, seed: int):
    vocab = vocab_of(train, schemas, domains)
    graphs = [sg.build_graph(sw.tokenize(it.question), schemas[it.db_id], vocab) for it in train]
    labels = [sg.gold_labels(g, it) for g, it in zip(graphs, train, strict=True)]
    model = sg.train_linker(graphs, labels, len(vocab) + 1, steps=cfg.linker_steps, batch=cfg.linker_batch,
                            lr=cfg.linker_lr, d=cfg.d, seed=seed)
    return model, vocab


def gold_tables(sql: str) -> set[str]:
    return {t.name.lower() for t in sg.parse(sql).find_all(exp.Table)}


def is_ambiguous(item: sw.Item, schema: sw.Schema) -> bool:
    """A column word of the question names columns in two or more tables of the gold query."""
    if not item.tokens:  # a folder's question: no gold alignment
        return False
    tabs = gold_tables(item.sql)
    words = {t.word for t in item.tokens if t.role[:1] == ("col",)}
    return any(sum(w in schema.columns(t) for t in tabs) >= 2 for w in words)


def error_kind(pred: str, gold: str) -> str:
    """The error taxonomy from AST diffs: invalid > join (table set) > linking (column set) > nesting > clause."""
    try:
        p, g = sg.parse(pred), sg.parse(gold)
    except sqlglot.errors.SqlglotError:
        return "invalid"
    cols = lambda t: {c.sql().lower() for c in t.find_all(exp.Column)}
    nest = lambda t: len(list(t.find_all(exp.Subquery, exp.Intersect, exp.Except, exp.Union)))
    if {x.name for x in p.find_all(exp.Table)} != {x.name for x in g.find_all(exp.Table)}:
        return "join"
    return "linking" if cols(p) != cols(g) else "nesting" if nest(p) != nest(g) else "clause"


@functools.lru_cache(maxsize=50_000)
def ast_bag(sql: str) -> frozenset:
    """The multiset of AST nodes of a query (node types; columns, tables and literals by their text)."""
    named = (exp.Column, exp.Table, exp.Literal)
    bag = Counter(type(n).__name__ + ":" + (n.sql().lower() if isinstance(n, named) else "")
                  for n in sg.parse(sql).walk())
    return frozenset(bag.items())


def exact_match(pred: str, gold: str) -> bool:
    """Exact set match: equal multisets of AST nodes, so clause and conjunct order do not matter (Spider's EM
    compares clause components as sets; values are compared too here)."""
    try:
        return ast_bag(pred) == ast_bag(gold)
    except sqlglot.errors.SqlglotError:
        return False


def score(item: sw.Item, db: Path, result: dict) -> dict:
    """Execution accuracy (multiset; ordered only under ORDER BY), exact set match, error kind."""
    try:
        gold_rows = sw.execute(db, item.sql)
    except sw.SQLFailure as e:
        return {"ex": False, "em": False, "why": f"the gold query fails ({e})", "error": "gold fails"}
    try:
        ok = sw.same_result(sw.execute(db, result["sql"]), gold_rows, "ORDER BY" in item.sql.upper())
        why = result["error"]
    except sw.SQLFailure as e:
        ok, why = False, result["error"] or str(e)
    return {"ex": ok, "em": ok and exact_match(result["sql"], item.sql), "why": why,
            "error": "" if ok else ("invalid" if why else error_kind(result["sql"], item.sql))}


CONTROL_ARM = {"no_linker": "no_linker", "direct_generation": "direct"}  # what the SGU arm becomes under a control


def run_arms(world: World, writer, linker, vocab, arms=ARMS, control: str = "", seed: int = 0,
             backend=None, items: list[sw.Item] | None = None) -> dict[str, list[dict]]:
    """Every arm on every held-out question (or `items`): the generated SQL, its steps and its scores. With the
    offline writer each arm is a cached stage, so a control recomputes nothing it does not change."""
    out = {}
    for a in arms:
        arm = CONTROL_ARM.get(control, a) if a == "sgu" else a
        if backend is None and items is None:
            out[a] = run_arm(world, writer, linker, vocab, arm, seed)
        else:
            out[a] = _run_arm(world, writer, linker, vocab, arm, seed, backend, items)
    return out


@stage
def run_arm(world: World, writer, linker, vocab, arm: str, seed: int) -> list[dict]:
    return _run_arm(world, writer, linker, vocab, arm, seed)


def _run_arm(world, writer, linker, vocab, arm, seed, backend=None, items=None) -> list[dict]:
    items = world.test if items is None else items
    backend = backend or Offline(writer, "template")
    if writer is not None:
        writer.prime([" ".join(mask(sw.tokenize(it.question), world.schemas[it.db_id])[0]) for it in items])
    graphs = [sg.build_graph(sw.tokenize(it.question), world.schemas[it.db_id], vocab) for it in items]
    rng, out = random.Random(seed), []
    for it, g, pr in zip(items, graphs, sg.predict(linker, graphs), strict=True):
        schema = world.schemas[it.db_id]
        links = (None if arm in ("direct", "no_linker") else sg.oracle_links(it, schema) if arm == "oracle"
                 else sg.link(g, schema, pr))
        mode = "direct" if arm.startswith("direct") else "random" if arm == "random_order" else "sgu"
        res = sg.generate(backend, schema, it.question, links, mode, rng)
        out.append({**res, **score(it, world.dbs[it.db_id], res), "links": links})
    return out


def ex_table(world: World, runs: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """EX per arm and slice: each hardness, hard+extra, ambiguous, all."""
    amb = [is_ambiguous(it, world.schemas[it.db_id]) for it in world.test]
    slices = {h: [it.hardness == h for it in world.test] for h in ("easy", "medium", "hard", "extra")}
    slices |= {"hard+extra": [it.hardness in HARD for it in world.test], "ambiguous": amb,
               "all": [True] * len(world.test)}
    mean = lambda xs: sum(xs) / max(len(xs), 1)
    return {a: {s: mean([r["ex"] for r, m in zip(rs, mask_, strict=True) if m]) for s, mask_ in slices.items()}
            | {"EM": mean([r["em"] for r in rs]), "n_ambiguous": sum(amb)} for a, rs in runs.items()}


def errors(runs: dict[str, list[dict]]) -> dict[str, Counter]:
    return {a: Counter(r["error"] for r in rs if r["error"]) for a, rs in runs.items()}


def linker_quality(world: World, linker, vocab) -> dict[str, float]:
    """Held-out column-link precision/recall, and accuracy on ambiguous words (the right table among several)."""
    tp = fp = fn = amb_ok = amb_n = 0
    graphs = [sg.build_graph(sw.tokenize(it.question), world.schemas[it.db_id], vocab) for it in world.test]
    for it, g, pr in zip(world.test, graphs, sg.predict(linker, graphs), strict=True):
        got = set(sg.link(g, world.schemas[it.db_id], pr)["columns"])
        gold = set(sg.oracle_links(it, world.schemas[it.db_id])["columns"])
        tp, fp, fn = tp + len(got & gold), fp + len(got - gold), fn + len(gold - got)
        for i in {i for i, _ in g.pairs}:
            cands = [(p, g.nodes[j][1:]) for (k, j), p in zip(g.pairs, pr[0], strict=True) if k == i]
            if len(cands) > 1 and it.tokens[i].role[:1] == ("col",):
                amb_n += 1
                amb_ok += max(cands)[1] == tuple(it.tokens[i].role[1:])
    return {"precision": tp / max(tp + fp, 1), "recall": tp / max(tp + fn, 1),
            "ambiguous_word_accuracy": amb_ok / max(amb_n, 1), "ambiguous_words": amb_n}


def ask(world: World, backend, linker, vocab, db_id: str, question: str) -> dict:
    """SGU on one typed question: the linked subgraph, each step's partial SQL with its execution result."""
    schema, db = world.schemas[db_id], world.dbs[db_id]
    words = sw.tokenize(question)
    g = sg.build_graph(words, schema, vocab)
    links = sg.link(g, schema, sg.predict(linker, [g])[0])
    res = sg.generate(backend, schema, question, links, "sgu")
    steps = []
    for clause, partial in res["steps"]:
        try:
            rows, why = sw.execute(db, partial)[:5], ""
        except sw.SQLFailure as e:
            rows, why = [], str(e)
        steps.append({"clause": clause, "sql": partial, "rows": rows, "error": why})
    return {**res, "question": question, "db_id": db_id, "links": links, "schema": schema, "steps": steps}


def world_from_folder(folder: str | Path, limit: int | None = None) -> World:
    """A Spider/BIRD-format folder as a World of held-out questions (no training questions)."""
    items, dbs = sw.load_spider(folder, limit)
    schemas = {d: sw.read_schema(p) for d, p in dbs.items()}
    return World(schemas, dbs, [], items, [], sorted(dbs), ("folder", str(Path(folder).resolve()), limit))


def subset(world: World, items: list[sw.Item]) -> World:
    return replace(world, test=list(items), key=(*world.key, "subset", len(items)))


def error_ratio(runs: dict[str, list[dict]], a: str, b: str) -> float:
    """(linking + join errors of arm a) / (those of arm b)."""
    count = lambda arm: sum(r["error"] in ("linking", "join") for r in runs[arm])
    return count(a) / max(count(b), 1)


def summary(runs: dict[str, list[dict]]) -> dict:
    """Per arm: EX, number of questions, failures by reason (what a checkpoint run records)."""
    return {a: {"n": len(rs), "ex": sum(r["ex"] for r in rs) / max(len(rs), 1),
                "failures": dict(Counter(r["error"] for r in rs if r["error"])),
                "first_reply": rs[0]["sql"][:200] if rs else ""} for a, rs in runs.items()}
