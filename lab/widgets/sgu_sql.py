"""SGU-SQL explorers: ask a question against a chosen database and see the linked schema subgraph, then each
incremental step's partial SQL and what it returns when executed; and execution accuracy by hardness per arm.

`ask_explorer` is the live panel (database, question); `steps_figure` the precomputed view for the report (a slider
over the recorded questions' steps, offline); `ex_figure` the bar chart.
"""

from __future__ import annotations

import html

import plotly.graph_objects as go

COLORS = {"direct": "#9D755D", "direct+linker": "#B279A2", "sgu": "#4C78A8", "no_linker": "#F58518",
          "random_order": "#72B7B2", "oracle": "#54A24B"}


def subgraph_html(answer: dict) -> str:
    """The schema with linked tables/columns highlighted and the FK joins of the linked subgraph."""
    links, parts = answer["links"], []
    for t, cols in answer["schema"].tables:
        on = t in links["tables"]
        cells = [f"<b style='color:#2a7'>{c}</b>" if (t, c) in links["columns"] else
                 f"<span style='color:{'#333' if on else '#aaa'}'>{c}</span>" for c in cols]
        name = f"<b style='color:#2a7'>{t}</b>" if on else f"<span style='color:#aaa'>{t}</span>"
        parts.append(f"{name}({', '.join(cells)})")
    joins = ", ".join(f"{a}.{x} = {b}.{y}" for a, x, b, y in links["joins"]) or "none"
    return "<br>".join(parts) + f"<br><i>joins on the FK path:</i> {html.escape(joins)}"


def steps_html(answer: dict) -> str:
    rows = []
    for s in answer["steps"]:
        got = html.escape(s["error"]) if s["error"] else html.escape(repr(s["rows"][:3]))
        rows.append(f"<tr><td><b>{s['clause'].upper()}</b></td><td><code>{html.escape(s['sql'])}</code></td>"
                    f"<td>{got}</td></tr>")
    return ("<table><tr><th>step</th><th>partial SQL</th><th>executes to (first rows)</th></tr>"
            + "".join(rows) + "</table>")


def ask_explorer(answer_fn, databases: list[str], question: str, db_id: str | None = None):
    """Live panel: `answer_fn(db_id, question) -> answer` (`sgu_sql_study.ask`). Hooks: `.db`, `.question`,
    `.html` (the rendered answer) and `.answer`."""
    import ipywidgets as w

    db = w.Dropdown(options=databases, value=db_id or databases[0], description="database")
    text = w.Text(value=question, description="question", layout=w.Layout(width="90%"))
    view = w.HTML()
    box = w.VBox([db, text, view])
    box.add_class("lab-explorer")
    box.db, box.question, box.html = db, text, view

    def update(_=None):
        box.answer = answer_fn(db.value, text.value)
        a = box.answer
        view.value = (f"<p><b>linked subgraph</b><br>{subgraph_html(a)}</p>{steps_html(a)}"
                      f"<p><b>final SQL</b> <code>{html.escape(a['sql'])}</code> {html.escape(a['error'])}</p>")

    db.observe(update, "value")
    text.observe(update, "value")
    update()
    return box


def steps_figure(answers: list[dict], *, title: str = "") -> go.Figure:
    """Precomputed view: one table per (question, step) — clause, partial SQL, result — and a slider over them."""
    fig, labels = go.Figure(), []
    for k, a in enumerate(answers):
        for s in a["steps"]:
            got = s["error"] or repr(s["rows"][:3])
            fig.add_trace(go.Table(header=dict(values=["", f"Q{k + 1} · {s['clause'].upper()}"]),
                                   cells=dict(values=[["question", "links", "partial SQL", "executes to"],
                                                      [a["question"], _links_line(a["links"]), s["sql"], got]]),
                                   columnwidth=[1, 6], visible=not labels))
            labels.append(f"Q{k + 1}·{s['clause']}")
    steps = [dict(label=lab, method="update", args=[{"visible": [j == i for j in range(len(labels))]}])
             for i, lab in enumerate(labels)]
    fig.update_layout(title=title, height=380, sliders=[dict(steps=steps, active=0, y=0.02)],
                      margin=dict(t=50, b=80))
    return fig


def _links_line(links: dict) -> str:
    cols = [f"{t}.{c}" for t, c in links["columns"]]
    return ", ".join(cols + [f"{a}.{x}={b}.{y}" for a, x, b, y in links["joins"]]) or "(none)"


def ex_figure(table: dict[str, dict[str, float]], slices=("easy", "medium", "hard", "extra", "ambiguous", "all"), *,
              title: str = "") -> go.Figure:
    """Grouped bars: execution accuracy per arm on each slice of the held-out questions."""
    fig = go.Figure([go.Bar(name=a, x=list(slices), y=[row[s] for s in slices], marker_color=COLORS.get(a))
                     for a, row in table.items()])
    fig.update_layout(barmode="group", title=title, yaxis_title="execution accuracy", yaxis_range=[0, 1.02],
                      height=380)
    return fig
