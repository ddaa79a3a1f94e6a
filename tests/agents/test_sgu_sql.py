"""SGU-SQL: the relation-aware layer against a per-pair loop, the joint graph on a hand case, link completion along
FK paths, the generation loop (syntax order, failures recorded), the offline writer's grounding, AST metrics, and
the checkpoint and Spider-folder paths through the runner."""

from __future__ import annotations

import json
import random

import pytest
import torch

from lab.agents import sgu_sql as sg
from lab.agents import sgu_sql_linker as sl
from lab.agents import sgu_sql_study as st
from lab.agents import sgu_sql_writer as wr
from lab.agents.backends import BackendError, Offline
from lab.data import sql_exec as sx
from lab.data import sql_plans as sp
from lab.data import sql_worlds as sw


@pytest.fixture(scope="module")
def concerts(tmp_path_factory):
    schema = sw.make_schema("concerts")
    return schema, sw.build_db(schema, tmp_path_factory.mktemp("db"), seed=0)


def test_relational_attention_matches_a_per_pair_loop():
    torch.manual_seed(0)
    layer = sl.RelationalAttention(8, len(sg.REL)).eval()
    h, rel = torch.randn(1, 5, 8), torch.randint(0, len(sg.REL), (1, 5, 5))
    mask = torch.tensor([[True, True, True, True, False]])
    got = layer(h, rel, torch.nn.functional.one_hot(rel, len(sg.REL)).float(), mask)
    q, k, v = layer.qkv(h).chunk(3, -1)
    mixed = torch.zeros(5, 8)
    for i in range(5):
        logits = torch.tensor([float((q[0, i] @ (k[0, j] + layer.rel_k[rel[0, i, j]])).detach()) / 8 ** 0.5
                               for j in range(4)])
        a = logits.softmax(0)
        mixed[i] = sum(a[j] * (v[0, j] + layer.rel_v[rel[0, i, j]]) for j in range(4))
    ref = layer.norm1(h[0] + layer.out(mixed))
    ref = layer.norm2(ref + layer.ff(ref))
    assert torch.allclose(got[0], ref, atol=1e-5)


def test_joint_graph_on_a_hand_case(concerts):
    schema, _ = concerts
    words = "what is the name of singers whose age is above 30".split()
    assert sg.dependencies(words) == [(3, 5), (5, 7)]
    g = sg.build_graph(words, schema, {"name": 1})
    idx = {n: k for k, n in enumerate(g.nodes)}
    assert g.rel[3, idx["col", "singer", "name"]] == sg.R["match"] and g.rel[5, idx["tab", "singer"]] == sg.R["match"]
    assert g.rel[idx["tab", "singer"], idx["col", "singer", "age"]] == sg.R["has-col"]
    assert g.rel[idx["col", "performance", "singer_id"], idx["col", "singer", "id"]] == sg.R["fk-col"]
    assert g.rel[3, 5] == sg.R["q-dep"] and g.rel[3, 4] == sg.R["q-adj"]
    name_pairs = [(i, g.nodes[j][1]) for i, j in g.pairs if i == 3]
    assert sorted(t for _, t in name_pairs) == ["concert", "singer", "stadium"]
    feats = {g.nodes[j][1]: f.tolist() for (i, j), f in zip(g.pairs, g.pair_feats, strict=True) if i == 3}
    assert feats["singer"][:4] == [1.0, 1.0, 0.0, 1.0] and feats["concert"][:4] == [0.0, 0.0, 0.0, 0.0]
    assert feats["singer"][4] == pytest.approx(1 / 3)


def test_links_are_completed_along_fk_paths(concerts):
    schema, _ = concerts
    links = sg.complete_links(schema, [("singer", "name"), ("stadium", "city")], [])
    assert links["tables"] == ["singer", "stadium", "performance", "concert"]
    assert len(links["joins"]) == 3
    text = sg.links_text(links)
    assert "singer.name" in text and "performance.singer_id = singer.id" in text


def test_link_keeps_the_best_column_per_word(concerts):
    schema, _ = concerts
    g = sg.build_graph("the name of singers".split(), schema, {})
    probs = [0.9 if g.nodes[j][1] == "singer" else 0.7 for _, j in g.pairs]
    links = sg.link(g, schema, (probs, [0.1] * len(g.tables)))
    assert links["columns"] == [("singer", "name")] and links["tables"] == ["singer"]


def test_generation_follows_the_syntax_tree_and_records_failures(concerts):
    schema, _ = concerts
    asked = []

    def agent(msgs):
        sec = wr.parse_prompt(msgs[-1]["content"])
        asked.append(sec.get("clause", "QUERY"))
        return {"FROM": "FROM singer", "SELECT": "SELECT singer.name", "QUERY": "```sql\nSELECT 1;\n```"}.get(
            sec.get("clause", "QUERY"), "NONE")

    res = sg.generate(Offline(agent, "t"), schema, "the name of singers?", None, "sgu")
    assert asked == ["FROM", "WHERE", "GROUP", "SELECT", "ORDER", "SETOP"]
    assert res["sql"] == "SELECT singer.name FROM singer" and res["error"] == ""
    assert sg.generate(Offline(agent, "t"), schema, "q?", None, "direct")["sql"] == "SELECT 1"
    asked.clear()
    sg.generate(Offline(agent, "t"), schema, "q?", None, "random", random.Random(3))
    assert sorted(asked) == sorted(a.upper() for a in sg.SYNTAX_ORDER) and asked != ["FROM", "WHERE", "GROUP",
                                                                                      "SELECT", "ORDER", "SETOP"]

    def down(msgs):
        raise BackendError("the endpoint did not answer.")

    assert sg.generate(Offline(down, "x"), schema, "q?", None)["error"] == "the endpoint did not answer."
    bad = sg.generate(Offline(lambda m: "SELECT FROM WHERE (((", "x"), schema, "q?", None, "direct")
    assert "does not parse" in bad["error"]


def test_gold_skeletons_with_gold_links_reproduce_the_gold_answers(concerts):
    """The writer's decoding is exact: gold clause skeletons + oracle links → the gold query's result, except where
    one column word names columns of two linked tables (a `Schema_links` list does not say which word is which)."""
    schema, db = concerts
    items = sp.make_items(schema, 150, random.Random(2))
    wrong = []
    for it in items:
        _, mentions = wr.mask(sw.tokenize(it.question), schema)
        links = sg.oracle_links(it, schema)
        linked = {f"{t}.{c}" for t, c in links["columns"]}
        plan = wr.decode(wr.skeleton(it), mentions, schema, linked, [t.role[1] for t in it.tokens if t.role[:1] ==
                                                                    ("tab",)])
        try:
            ok = sx.same_result(sx.execute(db, sp.render_sql(schema, plan)), sx.execute(db, it.sql),
                                "ORDER BY" in it.sql)
        except sx.SQLFailure:
            ok = False
        if not ok:
            wrong.append(it)
    twice = lambda it: any(len({t.role[1] for t in it.tokens if t.role[:1] == ("col",) and t.word == w}) > 1
                           for w in {t.word for t in it.tokens if t.role[:1] == ("col",)})
    assert len(wrong) < 0.1 * len(items) and all(twice(it) for it in wrong)


def test_name_grounding_prefers_links_then_the_from_tables(concerts):
    schema, _ = concerts
    assert wr.ground_col("name", schema, set(), []) == "singer.name"  # the first listed
    assert wr.ground_col("name", schema, set(), ["concert"]) == "concert.name"
    assert wr.ground_col("name", schema, {"stadium.name"}, ["concert"]) == "stadium.name"


def test_ast_metrics_ignore_conjunct_order_and_classify_errors():
    a = "SELECT s.name FROM s WHERE s.age > 3 AND s.city = 'x'"
    assert st.exact_match(a, "SELECT s.name FROM s WHERE s.city = 'x' AND s.age > 3")
    assert not st.exact_match(a, "SELECT s.name FROM s WHERE s.city = 'y' AND s.age > 3")
    assert st.error_kind("SELECT c.name FROM c", "SELECT s.name FROM s") == "join"
    assert st.error_kind("SELECT s.city FROM s", "SELECT s.name FROM s") == "linking"
    nested = "SELECT s.name FROM s WHERE s.name IN (SELECT s.name FROM s)"
    assert st.error_kind(nested, "SELECT s.name FROM s") == "nesting"
    assert st.error_kind("SELECT s.name FROM s ORDER BY s.name", "SELECT s.name FROM s") == "clause"
    assert st.error_kind("SELECT FROM (((", "SELECT s.name FROM s") == "invalid"


def test_linker_learns_to_resolve_ambiguous_names(tmp_path):
    cfg = st.Config.for_scale("smoke", per_domain_train=40, per_domain_test=20, linker_steps=60)
    world = st.build_world(cfg, 0, tmp_path)
    linker, vocab = st.train_linker(world, cfg, 0)
    q = st.linker_quality(world, linker, vocab)
    assert q["ambiguous_words"] > 50 and q["ambiguous_word_accuracy"] > 0.9 and q["recall"] > 0.9


def test_controls_change_only_the_sgu_arm_and_unseen_skeletons_count_by_hand(tmp_path):
    cfg = st.Config.for_scale("smoke", per_domain_train=30, per_domain_test=10, linker_steps=20)
    world = st.build_world(cfg, 0, tmp_path)
    linker, vocab = st.train_linker(world, cfg, 0)
    fresh = sl.untrained_copy(linker, 3)  # the architecture at a seeded initialisation: same shapes, other weights
    assert all(a.shape == b.shape for a, b in zip(fresh.state_dict().values(), linker.state_dict().values()))
    assert any(not torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), linker.state_dict().values()))
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                  sl.untrained_copy(linker, 3).state_dict().values()))
    writer = wr.train_writer(world.train, world.schemas, cfg.C)
    view = writer.whole_query_clauses()
    masked = " ".join(wr.mask(sw.tokenize(world.test[0].question), world.schemas[world.test[0].db_id])[0])
    assert view.labels(masked, "where") == writer.labels(masked, "query") and not writer.from_whole
    assert writer.__stage_key__() != view.__stage_key__()
    base = st.run_arms(world, writer, linker, vocab, ("direct", "sgu"), "", 0, items=world.test)
    for control, what in (("untrained_linker", "links"), ("whole_query_clauses", "sql")):
        ctl = st.run_arms(world, writer, linker, vocab, ("direct", "sgu"), control, 0, items=world.test)
        assert [r["sql"] for r in ctl["direct"]] == [r["sql"] for r in base["direct"]]  # the other arms as they are
        assert [r[what] for r in ctl["sgu"]] != [r[what] for r in base["sgu"]]  # the SGU arm changed
    with pytest.raises(ValueError, match="unknown control"):
        st.run_arms(world, writer, linker, vocab, ("sgu",), "no_linker", 0, items=world.test[:1])
    whole = lambda it: "|".join(wr.skeleton(it)[c] for c in sg.SYNTAX_ORDER)  # brute force over the train set
    hard = [it for it in world.test if it.hardness in st.HARD]
    want = sum(all(whole(it) != whole(t) for t in world.train) for it in hard) / len(hard)
    assert st.unseen_skeletons(world)["whole query unseen"] == pytest.approx(want)


@pytest.mark.notebook
def test_checkpoint_and_spider_folder(tmp_path, concerts):
    """model=<folder> drives the same loop with a saved tiny Llama (its answers are recorded failures) and
    data=<Spider folder> evaluates that folder's questions."""
    from lab.models.tokenizer import word_tokenizer

    from ..conftest import run_lab, save_tiny_lm

    schema, db = concerts
    sx.spider_folder(tmp_path / "spider", sp.make_items(schema, 6, random.Random(0)), {"concerts": db})
    tok = word_tokenizer("SELECT FROM WHERE singer name . , = 1 ; NONE".split())
    save_tiny_lm(tmp_path / "ckpt", tok, d_model=16, n_layers=1, n_heads=2)
    proc = run_lab("run", "18_sgu_sql", "-p", "model", str(tmp_path / "ckpt"), "-p", "data", str(tmp_path / "spider"),
                   "--out", str(tmp_path / "out"), "--no-page")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rec = json.loads((tmp_path / "out" / "18_sgu_sql.json").read_text())
    assert rec["status"] == "measured" and rec["claims"] == []
    ck = rec["metrics"]["checkpoint"]
    assert set(ck["arms"]) == {"direct", "sgu"} and ck["arms"]["sgu"]["n"] == 3
    assert ck["arms"]["direct"]["ex"] == 0 and sum(ck["arms"]["direct"]["failures"].values()) == 3
    assert ck["folder"]["sgu"]["n"] == 6


def test_widgets_build(concerts):
    from lab.widgets.sgu_sql import ask_explorer, ex_figure, steps_figure

    schema, _ = concerts
    calls = []

    def answer(db_id, q):
        calls.append((db_id, q))
        links = sg.complete_links(schema, [("singer", "name")], [])
        return {"question": q, "db_id": db_id, "links": links, "schema": schema, "sql": "SELECT 1", "error": "",
                "steps": [{"clause": "from", "sql": "FROM singer", "rows": [], "error": "no SELECT"},
                          {"clause": "select", "sql": "SELECT singer.name FROM singer", "rows": [("a",)], "error": ""}]}

    box = ask_explorer(answer, ["concerts", "school"], "the name of singers?")
    box.question.value = "how many singers?"
    box.db.value = "school"
    assert calls[-1] == ("school", "how many singers?") and "singer.name" in box.html.value
    assert "<b style='color:#2a7'>name</b>" in box.html.value and "no SELECT" in box.html.value
    fig = steps_figure([answer("concerts", "q1"), answer("concerts", "q2")])
    assert len(fig.data) == 4 and len(fig.layout.sliders[0].steps) == 4
    row = dict.fromkeys(("easy", "medium", "hard", "extra", "ambiguous", "all"), 0.5)
    assert len(ex_figure({"sgu": row, "direct": row}).data) == 2


def test_the_loop_runs_through_a_local_http_endpoint_and_records_an_unreachable_one(concerts):
    """The same generation loop against a real OpenAI-compatible server on 127.0.0.1 (serving an offline agent),
    and against a port nobody listens on: a recorded failure, not an exception."""
    import socket

    from lab.agents.backends import OpenAIHTTP, serve

    schema, _ = concerts
    agent = Offline(lambda m: {"FROM": "FROM singer", "SELECT": "SELECT singer.name"}.get(
        wr.parse_prompt(m[-1]["content"]).get("clause", ""), "NONE"), "t")
    server, url = serve(agent)
    try:
        res = sg.generate(OpenAIHTTP("t", base_url=url, api_key="x"), schema, "names of singers?", None, "sgu")
    finally:
        server.shutdown()
    assert res["sql"] == "SELECT singer.name FROM singer" and res["error"] == ""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = OpenAIHTTP("t", base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=2, max_retries=0)
    res = sg.generate(down, schema, "names of singers?", None, "direct")
    assert res["sql"] == "" and "did not answer" in res["error"]
