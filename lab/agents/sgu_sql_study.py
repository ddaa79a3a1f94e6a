"""The SGU-SQL toy: procedural databases split by domain, the trained linker, an offline clause writer standing in
for the LLM, and the arms the paper compares (`lab.agents.sgu_sql` holds the method).

The offline writer that stands in for the LLM is `lab.agents.sgu_sql_writer` (its docstring says what it can and
cannot do).

Everything that differs between the arms is therefore what the paper varies: the links shown (none, the dual-graph
linker's, the gold ones) and how generation is decomposed (one prompt, syntax-tree order, random order).
"""

from __future__ import annotations

import functools
import random
from collections import Counter, defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

import sqlglot
from sqlglot import exp

from lab.agents import sgu_sql as sg
from lab.agents import sgu_sql_linker as sl
from lab.agents.backends import Offline
from lab.agents.sgu_sql_writer import mask
from lab.core.stages import stage
from lab.data import sql_exec as sx
from lab.data import sql_plans as sp
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
    make = lambda d, n, tag: sp.make_items(sw.make_schema(d), n, random.Random(f"{seed}:{d}:{tag}"))
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
    labels = [sl.gold_labels(g, it) for g, it in zip(graphs, train, strict=True)]
    model = sl.train_linker(graphs, labels, len(vocab) + 1, steps=cfg.linker_steps, batch=cfg.linker_batch,
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
        gold_rows = sx.execute(db, item.sql)
    except sx.SQLFailure as e:
        return {"ex": False, "em": False, "why": f"the gold query fails ({e})", "error": "gold fails"}
    try:
        ok = sx.same_result(sx.execute(db, result["sql"]), gold_rows, "ORDER BY" in item.sql.upper())
        why = result["error"]
    except sx.SQLFailure as e:
        ok, why = False, result["error"] or str(e)
    return {"ex": ok, "em": ok and exact_match(result["sql"], item.sql), "why": why,
            "error": "" if ok else ("invalid" if why else error_kind(result["sql"], item.sql))}


CONTROLS = {  # what a skeptic would change inside the SGU arm (the other arms run as they are)
    "untrained_linker": "the SGU arm links with the linker at its initialisation (no training step): the same graph "
                        "network and threshold, links that learned nothing",
    "whole_query_clauses": "the SGU arm's writer answers each clause prompt from its whole-query skeleton prediction "
                           "(the direct prompt's classifier) instead of that clause's: the same steps, prompts and "
                           "links, without per-clause predictions",
}


def run_arms(world: World, writer, linker, vocab, arms=ARMS, control: str = "", seed: int = 0,
             backend=None, items: list[sw.Item] | None = None) -> dict[str, list[dict]]:
    """Every arm on every held-out question (or `items`): the generated SQL, its steps and its scores. With the
    offline writer each arm is a cached stage, so a control recomputes nothing it does not change."""
    if control and control not in CONTROLS:
        raise ValueError(f"unknown control {control!r}; use one of {', '.join(CONTROLS)}")
    out = {}
    for a in arms:
        w, lk = writer, linker
        if a == "sgu" and control == "untrained_linker":
            lk = sl.untrained_copy(linker, seed)
        elif a == "sgu" and control == "whole_query_clauses" and writer is not None:
            w = writer.whole_query_clauses()
        if backend is None and items is None:
            out[a] = run_arm(world, w, lk, vocab, a, seed)
        else:
            out[a] = _run_arm(world, w, lk, vocab, a, seed, backend, items)
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
    for it, g, pr in zip(items, graphs, sl.predict(linker, graphs), strict=True):
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
    tp = fp = fn = amb_ok = amb_n = rule_ok = 0
    graphs = [sg.build_graph(sw.tokenize(it.question), world.schemas[it.db_id], vocab) for it in world.test]
    for it, g, pr in zip(world.test, graphs, sl.predict(linker, graphs), strict=True):
        got = set(sg.link(g, world.schemas[it.db_id], pr)["columns"])
        gold = set(sg.oracle_links(it, world.schemas[it.db_id])["columns"])
        tp, fp, fn = tp + len(got & gold), fp + len(got - gold), fn + len(gold - got)
        for i in {i for i, _ in g.pairs}:
            cands = [(p, g.nodes[j][1:]) for (k, j), p in zip(g.pairs, pr[0], strict=True) if k == i]
            if len(cands) > 1 and it.tokens[i].role[:1] == ("col",):
                amb_n += 1
                amb_ok += max(cands)[1] == tuple(it.tokens[i].role[1:])
                rule = max((tuple(f[:2].tolist()), g.nodes[j][1:]) for (k, j), f in zip(g.pairs, g.pair_feats,
                                                                                        strict=True) if k == i)
                rule_ok += rule[1] == tuple(it.tokens[i].role[1:])
    return {"precision": tp / max(tp + fp, 1), "recall": tp / max(tp + fn, 1),
            "ambiguous_word_accuracy": amb_ok / max(amb_n, 1), "ambiguous_words": amb_n,
            "ambiguous_word_accuracy, rule on two pair features": rule_ok / max(amb_n, 1)}


def unseen_skeletons(world: World) -> dict[str, float]:
    """Share of the held-out hard+extra questions whose whole-query skeleton (`sgu_sql_writer.skeleton`, all six
    clauses) never occurs in training, and whose skeleton has a clause label never seen in training: the offline
    writer's direct prompt cannot write the first kind (one label per whole query), its clause prompts the second."""
    from lab.agents import sgu_sql_writer as wr

    seen = [wr.skeleton(it) for it in world.train]
    whole = {tuple(s[c] for c in sg.SYNTAX_ORDER) for s in seen}
    per = {c: {s[c] for s in seen} for c in sg.SYNTAX_ORDER}
    hard = [wr.skeleton(it) for it in world.test if it.hardness in HARD]
    n = max(len(hard), 1)
    return {"whole query unseen": sum(tuple(s[c] for c in sg.SYNTAX_ORDER) not in whole for s in hard) / n,
            "a clause unseen": sum(any(s[c] not in per[c] for c in sg.SYNTAX_ORDER) for s in hard) / n}


def ask(world: World, backend, linker, vocab, db_id: str, question: str) -> dict:
    """SGU on one typed question: the linked subgraph, each step's partial SQL with its execution result."""
    schema, db = world.schemas[db_id], world.dbs[db_id]
    words = sw.tokenize(question)
    g = sg.build_graph(words, schema, vocab)
    links = sg.link(g, schema, sl.predict(linker, [g])[0])
    res = sg.generate(backend, schema, question, links, "sgu")
    steps = []
    for clause, partial in res["steps"]:
        try:
            rows, why = sx.execute(db, partial)[:5], ""
        except sx.SQLFailure as e:
            rows, why = [], str(e)
        steps.append({"clause": clause, "sql": partial, "rows": rows, "error": why})
    return {**res, "question": question, "db_id": db_id, "links": links, "schema": schema, "steps": steps}


def world_from_folder(folder: str | Path, limit: int | None = None) -> World:
    """A Spider/BIRD-format folder as a World of held-out questions (no training questions)."""
    items, dbs = sx.load_spider(folder, limit)
    schemas = {d: sx.read_schema(p) for d, p in dbs.items()}
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
