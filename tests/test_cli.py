"""The runner on small synthetic notebooks (no torch in the kernel): statuses, files, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import nbformat
import pytest

from lab.core.runner import parse_value, resolve

from .conftest import ROOT

PARAMS = 'scale = "smoke"\ndevice = "auto"\nseed = 0\nmodel = "tiny"\ncontrol = ""'
SETUP = ('import lab.core\nP = lab.core.setup(scale, device, seed, model, control, '
         'controls={"flip": ["holds"], "weak": ["holds", "also"]})')


def write_nb(folder, stem, body, title="Synthetic", text="Results."):
    v4 = nbformat.v4
    nb = v4.new_notebook(cells=[v4.new_markdown_cell(f"# {title}"),
                                v4.new_code_cell(PARAMS, metadata={"tags": ["parameters"]}),
                                v4.new_code_cell(SETUP), v4.new_code_cell(body), v4.new_markdown_cell(text),
                                v4.new_code_cell("lab.core.verdict()")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, folder / f"{stem}.ipynb")


def lab(*args, nbdir, env=None):
    return subprocess.run([sys.executable, "-m", "lab", "--notebooks", str(nbdir), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=env)


GOOD = ('from lab.core import check, record\nrecord("m", {"a": 1})\n'
        'check("holds", 0.9 + seed - 2 * (P.control != ""), ">=", 0.5)\n'
        'check("also", 1.0, ">=", 0.5)\nlab.core.sanity("s", 0.0, "<", 1.0)')

GOOD_TEXT = "holds: 0.9–1.9 <!-- seeds: {holds} -->; m: 2 <!-- seeds: {m|a} -->"  # stated numbers, one wrong


@pytest.fixture(scope="module")
def nbdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("nbs")
    write_nb(d, "01_good", GOOD, text=GOOD_TEXT)
    write_nb(d, "02_claim", 'from lab.core import check\ncheck("breaks", 0.1, ">=", 0.5)\n'
                            'check("breaks too", 0.2, ">=", 0.5)\nprint("reached: claims do not raise")')
    write_nb(d, "03_crash", 'raise RuntimeError("boom")')
    write_nb(d, "04_measured", 'lab.core.record("m", {"a": 1})')
    return d


@pytest.mark.timeout(300)
def test_run_all_writes_records_pages_and_index(nbdir, tmp_path):
    proc = lab("run", "01_good", "02_claim", "03_crash", "-p", "seed", "2", "--out", str(tmp_path), nbdir=nbdir)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # one failed claim, one crash
    recs = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    good, claim, crash = recs["01_good"], recs["02_claim"], recs["03_crash"]
    assert good["status"] == "passed" and good["params"]["seed"] == 2 and good["title"] == "Synthetic"
    assert good["claims"][0] == {"name": "holds", "value": 2.9, "op": ">=", "threshold": 0.5, "passed": True}
    assert good["sanity"] == [{"name": "s", "value": 0.0, "op": "<", "threshold": 1.0, "passed": True}]
    assert good["metrics"] == {"m": {"a": 1}} and good["seconds"] > 0 and good["params"]["control"] == ""
    assert claim["status"] == "failed" and [c["passed"] for c in claim["claims"]] == [False, False]
    assert "measured 0.1, required >= 0.5" in claim["error"] and "breaks too" in claim["error"]
    assert crash["status"] == "error" and "boom" in crash["error"] and crash["claims"] == []
    for stem in recs:  # a failed notebook keeps its executed copy, marked by papermill
        assert (tmp_path / f"{stem}.ipynb").exists() and (tmp_path / f"{stem}.html").exists()
    assert nbformat.read(tmp_path / "02_claim.ipynb", as_version=4).metadata.papermill.exception
    index = (tmp_path / "index.html").read_text()
    assert all(s in index for s in ("01_good", "02_claim", "03_crash", "passed", "failed", "error"))
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.timeout(300)
def test_a_run_that_checks_no_claim_reads_measured_not_passed(nbdir, tmp_path):
    proc = lab("run", "04_measured", "--out", str(tmp_path), nbdir=nbdir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rec = json.loads((tmp_path / "04_measured.json").read_text())
    assert rec["status"] == "measured" and rec["claims"] == [] and rec["metrics"] == {"m": {"a": 1}}
    assert "measured" in proc.stdout and '<td class="measured">measured</td>' in (tmp_path / "index.html").read_text()


@pytest.mark.timeout(300)
def test_a_failed_rerun_replaces_a_stale_success(nbdir, tmp_path):
    assert lab("run", "good", "--out", str(tmp_path), nbdir=nbdir).returncode == 0
    assert json.loads((tmp_path / "01_good.json").read_text())["status"] == "passed"
    write_nb(nbdir, "01_good", 'raise ValueError("now broken")')
    try:
        assert lab("run", "01_good", "--out", str(tmp_path), nbdir=nbdir).returncode == 1
        assert json.loads((tmp_path / "01_good.json").read_text())["status"] == "error"
    finally:
        write_nb(nbdir, "01_good", GOOD, text=GOOD_TEXT)
    listing = lab("list", "--out", str(tmp_path), nbdir=nbdir).stdout
    assert "01_good" in listing and "error" in listing and "never run" in listing
    rep = lab("report", "--out", str(tmp_path), nbdir=nbdir)
    assert rep.returncode == 0 and (tmp_path / "index.html").exists()


@pytest.mark.timeout(300)
def test_a_control_run_fails_and_says_which_claims_it_broke(nbdir, tmp_path):
    proc = lab("run", "good", "-p", "control", "weak", "-p", "seed", "0", "--out", str(tmp_path), nbdir=nbdir)
    assert proc.returncode == 1 and "NOT broken: also" in proc.stdout, proc.stdout + proc.stderr
    rec = json.loads((tmp_path / "01_good.json").read_text())
    assert rec["status"] == "failed" and rec["params"]["control"] == "weak"
    assert rec["control"] == {"name": "weak", "must_break": ["holds", "also"], "broken": ["holds"],
                              "survived": ["also"]}


@pytest.mark.timeout(300)
def test_sweep_writes_a_results_file_and_its_table(nbdir, tmp_path):
    from lab.core.results import problems, seed_table

    target = tmp_path / "results" / "01_good.json"
    proc = lab("sweep", "good", "--seeds", "0-1", "--out", str(target), nbdir=nbdir)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # control 'weak' does not break 'also'
    data = json.loads(target.read_text())
    assert data["seeds"] == [0, 1] and [r["values"]["holds"] for r in data["runs"]] == [0.9, 1.9]
    import torch

    assert data["machine"]["torch"] == torch.__version__ and data["machine"]["cpu_capability"]
    assert data["claims"]["holds"] == {"op": ">=", "threshold": 0.5}
    assert data["runs"][1]["metrics"] == data["controls"]["flip"]["metrics"] == {"m": {"a": 1}}
    assert "stated numbers: 1/2 match this sweep" in proc.stdout  # m|a is 1, not 2
    assert "states 2, the sweep recorded 1" in proc.stdout
    assert "replaced ran on a machine it does not name" in proc.stdout  # no earlier file: another CPU may differ
    assert data["controls"]["flip"]["broken"] == ["holds"] and data["controls"]["weak"]["survived"] == ["also"]
    table = seed_table("01_good", tmp_path)
    assert table.loc["holds", "min"] == "0.9" and table.loc["holds", "seeds"] == "2/2"
    assert table.loc["holds", "control flip"].endswith("✗") and table.loc["also", "control weak"].endswith("(held!)")
    claims = [{"name": "holds", "op": ">=", "threshold": 1.0}, {"name": "also", "op": ">=", "threshold": 0.5}]
    found = problems("01_good", claims, {"flip": ["holds"], "weak": ["holds", "also"]}, folder=tmp_path,
                     seeds=range(2))
    assert found == ["seed 0: holds = 0.9 does not meet >= 1.0", "control 'weak' does not break 'also' (recorded 1)"]
    assert "seeds [2, 3" in problems("01_good", claims[1:], {}, folder=tmp_path)[1]


@pytest.mark.timeout(300)
def test_a_control_on_several_seeds_breaks_a_claim_only_if_it_breaks_it_on_every_seed(nbdir, tmp_path):
    """`--control-seeds 0-2`: the control `flip` gives holds = seed − 1.1, so it breaks "holds" on seeds 0 and 1 and
    not on seed 2; every seed's run is recorded, and the claim counts as not broken."""
    from lab.core.results import problems, seed_table

    target = tmp_path / "results" / "01_good.json"
    proc = lab("sweep", "good", "--seeds", "0", "--control-seeds", "0-2", "--out", str(target), nbdir=nbdir)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    flip = json.loads(target.read_text())["controls"]["flip"]
    assert flip["broken"] == [] and flip["survived"] == ["holds"] and sorted(flip["by_seed"]) == ["0", "1", "2"]
    assert [flip["by_seed"][s]["values"]["holds"] for s in "012"] == pytest.approx([-1.1, -0.1, 0.9])
    assert flip["seed"] == 0 and flip["values"]["holds"] == pytest.approx(-1.1)  # the lowest seed's run
    assert "control flip: broke 0/1 on seeds 0, 1, 2; held: ['holds']" in proc.stdout
    assert seed_table("01_good", tmp_path).loc["holds", "control flip"].endswith("(held on seed 2!)")
    claims = [{"name": "holds", "op": ">=", "threshold": 0.5}, {"name": "also", "op": ">=", "threshold": 0.5}]
    found = problems("01_good", claims, {"flip": ["holds"]}, folder=tmp_path, seeds=range(1))
    assert found == ["control 'flip' does not break 'holds' on seed 2 (recorded 0.9)"]


@pytest.mark.timeout(300)
def test_audit_sweeps_held_out_and_control_seeds_into_its_folder_and_says_what_did_not_hold(nbdir, tmp_path):
    """`lab audit good --seeds 2-3 --control-seeds 1,2`: the claims hold on seeds 2-3, control `flip` (holds =
    seed − 1.1) breaks "holds" on seed 1 but not on seed 2, and `weak` never breaks "also": exit 1, audit.md names
    both, the results file lands under OUT/results, and each sweep's run folders are removed (kept with --keep-runs)."""
    import os

    out, tmp = tmp_path / "audit", tmp_path / "tmp"
    tmp.mkdir()
    proc = lab("audit", "good", "--seeds", "2-3", "--control-seeds", "1,2", "--out", str(out), nbdir=nbdir,
               env={**os.environ, "TMPDIR": str(tmp)})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    data = json.loads((out / "results" / "01_good.json").read_text())
    assert data["seeds"] == [2, 3] and sorted(data["controls"]["flip"]["by_seed"]) == ["1", "2"]
    text = (out / "audit.md").read_text()
    assert "| 01_good | [2, 3] | 2/2 | 1, 2 | 0/2 | also = 1 (>= 0.5) |" in text
    assert "- 01_good: control 'flip' does not break 'holds' on seed 2 (recorded 0.9)" in text
    assert "- 01_good: control 'weak' does not break 'also' on seed 1 (recorded 1)" in text
    assert not list(tmp.glob("lab-sweep-*"))
    proc = lab("sweep", "good", "--seeds", "0", "--no-controls", "--keep-runs", "--out", str(tmp_path / "r.json"),
               nbdir=nbdir, env={**os.environ, "TMPDIR": str(tmp)})
    [kept] = tmp.glob("lab-sweep-01_good-*")
    assert proc.returncode == 0 and f"kept in {kept}" in proc.stdout and (kept / "method-0" / "01_good.json").exists()


def test_bad_names_and_parameters_write_nothing(nbdir, tmp_path):
    out = tmp_path / "r"
    for args, words in [(("run", "nope"), "no notebook named 'nope'"),
                        (("run", "good", "-p", "control", "nonsense"), "its controls are 'flip', 'weak'"),
                        (("run", "all", "-p", "scale", "big"), "scale='big'"),
                        (("run", "all", "-p", "colour", "red"), "no parameter 'colour'")]:
        proc = lab(*args, "--out", str(out), nbdir=nbdir)
        assert proc.returncode == 2 and words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("args, words", [
    (("-p", "s", "1.5"), "error: 07_olica: s=1.5: out of range; this notebook needs 0 < s < 1."),
    (("-p", "s", "abc"), "error: 07_olica: s='abc' is not a number (its default is 0.33)."),
    (("-p", "mlp_num", "2.5"), "error: 07_olica: mlp_num=2.5 is not an integer (its default is 3).")])
def test_a_paper_knob_out_of_its_limits_or_type_is_refused_before_a_kernel_starts(tmp_path, args, words):
    """The paper's own knobs (here Olica's sparsity s and mlp_num): checked by the runner against their defaults'
    types and `lab.papers` limits: one sentence, exit 2, nothing written (these ran ~20 s into the notebook and
    died in a widget or a tensor shape)."""
    out = tmp_path / "r"
    proc = lab("run", "07_olica", *args, "--out", str(out), nbdir=ROOT / "notebooks")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [words], proc.stderr
    assert not out.exists()


def test_each_notebook_types_its_own_knobs():
    """`run olica over_tokenized -p k 2`: k is Olica's float and Over-Tokenized's int; one notebook's conversion
    must not reach the next (it refused 17 with 'k=2.0 is not an integer')."""
    from lab.core.runner import plan, resolve

    todo = plan(resolve(["olica", "over_tokenized"], ROOT / "notebooks"), {"k": 2})
    assert [(p.stem, ov["k"], type(ov["k"])) for p, ov, _ in todo] == [("07_olica", 2.0, float),
                                                                      ("17_over_tokenized", 2, int)]


def test_checkpoint_only_knobs_on_the_tiny_path_are_named_not_silently_ignored():
    from lab.core.runner import unused_on_tiny

    nb = ROOT / "notebooks" / "05_floe.ipynb"
    over = {"n_blocks": 3, "k": 0.7, "dtype": "bfloat16"}
    assert unused_on_tiny(nb, over, {"model": "tiny"}) == ["n_blocks", "dtype"]  # k is the toy's too
    assert unused_on_tiny(nb, over, {"model": "/some/checkpoint"}) == []


def test_params_lists_each_knob_with_its_default_limits_and_meaning_and_the_controls():
    proc = lab("params", "olica", nbdir=ROOT / "notebooks")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    i = lines.index("  s = 0.33  [0 < s < 1; 2 * s < 1 + k; s <= 0.4 or 2 * k * s < 1 + k]")
    assert lines[i + 1].strip() == "target sparsity of all parameters (embeddings included)"
    assert "  seed = 0" in lines
    assert any(line.startswith("  control 'shuffled_lc' must break: LC residual of E") for line in lines)
    bad = lab("params", "nope", nbdir=ROOT / "notebooks")
    assert bad.returncode == 2 and "no notebook named 'nope'" in bad.stderr


@pytest.mark.parametrize("error", ["lab.core.ParamError", "__import__('lab.data.text').data.text.DataNotAvailable"])
def test_a_notebook_that_refuses_its_input_is_one_sentence_and_writes_nothing(tmp_path, error):
    """Bad input found inside the kernel (a wrong model family, unreadable data) is one sentence, not a crash."""
    nbs, out = tmp_path / "nbs", tmp_path / "r"
    nbs.mkdir()
    write_nb(nbs, "01_refuse", f'raise {error}("model=\'x\' is a dense model; this needs an MoE.")')
    proc = lab("run", "01_refuse", "--out", str(out), nbdir=nbs)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "error: 01_refuse: model='x' is a dense model; this needs an MoE."
    assert not out.exists()


def test_resolve_and_parse(nbdir):
    assert [p.stem for p in resolve(["claim", "01_good"], nbdir)] == ["02_claim", "01_good"]
    assert len(resolve(["all"], nbdir)) == 4
    assert [parse_value(v) for v in ("3", "0.5", "True", "none", "smoke", "org/model")] == \
        [3, 0.5, True, None, "smoke", "org/model"]


def test_bench_registry():
    from lab.core import bench

    calls = []
    bench.register("_probe")(lambda P, argv: calls.append((P, argv)) or 3)
    try:
        assert "_probe" in bench.names() and bench.get("_probe")("params", ["--x", "1"]) == 3
        assert calls == [("params", ["--x", "1"])]
        with pytest.raises(bench.BenchError, match="no bench named 'nope'; known: .*_probe"):
            bench.get("nope")
    finally:
        bench._BENCHES.pop("_probe")


def test_bench_dispatch_names_no_paper(nbdir):
    """`bench NAME` goes to the registry the paper modules fill (listed in lab.papers): the runner itself holds
    no paper's name, and an unknown bench or option is one sentence."""
    import ast
    import re

    from lab.papers import PAPERS

    tree = ast.parse((ROOT / "lab" / "cli.py").read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, ast.Module | ast.FunctionDef | ast.ClassDef)
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    words = [n.value if isinstance(n, ast.Constant) else getattr(n, "id", getattr(n, "attr", ""))
             for n in ast.walk(tree) if id(n) not in docs]  # identifiers and constants; docstrings hold examples
    code = " ".join(map(str, words)).lower()
    assert not [p.slug for p in PAPERS if re.search(rf"\b{p.slug}\b", code)]
    assert any(p.bench for p in PAPERS)
    proc = lab("bench", "nope", "--device", "cpu", nbdir=nbdir)
    assert proc.returncode == 2 and "no bench named 'nope'" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    proc = lab("list", "--bogus", nbdir=nbdir)
    assert proc.returncode == 2 and "unrecognized arguments: --bogus" in proc.stderr
