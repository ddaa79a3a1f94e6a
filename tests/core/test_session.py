import logging
import random

import numpy as np
import pytest
import torch

from lab.core import ParamError, progress, setup


def test_setup_seeds_everything_and_caps_threads():
    before = torch.get_num_threads()
    try:
        setup("smoke", "cpu", 7)
        a = (random.random(), np.random.rand(), torch.rand(1).item())
        setup("smoke", "cpu", 7)
        assert (random.random(), np.random.rand(), torch.rand(1).item()) == a
        assert torch.get_num_threads() == 1
        assert logging.getLogger().level == logging.INFO
        import plotly.io as pio

        assert pio.renderers.default == "plotly_mimetype"
    finally:
        torch.set_num_threads(before)


def test_setup_rejects_before_doing_anything():
    with pytest.raises(ParamError):
        setup(scale="huge")


def test_progress_quiet_switch():
    bar = progress(range(3), quiet=True)
    assert bar.disable and list(bar) == [0, 1, 2]
    assert not progress(range(3), quiet=False).disable


@pytest.mark.parametrize("headless", [False, True])
def test_autoreload_stays_on_interactively_and_is_off_under_the_runner(headless, monkeypatch, tmp_path):
    from IPython import get_ipython
    from IPython.testing.globalipapp import start_ipython

    from lab.core import records

    ip = start_ipython() or get_ipython()  # one shell per process: started by the first call
    ip.run_line_magic("load_ext", "autoreload")
    ip.run_line_magic("autoreload", "2")
    monkeypatch.delenv(records.RECORD_FILE_ENV, raising=False)
    if headless:
        monkeypatch.setenv(records.RECORD_FILE_ENV, str(tmp_path / "records.jsonl"))
    before = torch.get_num_threads()
    try:
        setup("smoke", "cpu", 0)
    finally:
        torch.set_num_threads(before)
        monkeypatch.delenv(records.RECORD_FILE_ENV, raising=False)
    assert ip.magics_manager.registry["AutoreloadMagics"]._reloader.enabled is not headless
    ip.run_line_magic("autoreload", "0")


def test_setup_silences_what_the_libraries_say_about_each_other_and_tiny_models_progress_bars():
    """peft's read of a deprecated transformers attribute and transformers' own assisted-generation deprecation are
    dropped; other warnings and log records pass; on the tiny path transformers draws no progress bars."""
    import warnings
    from pathlib import Path

    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    try:
        setup("smoke", "cpu", 0)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("default")
            from lab.core import session

            session._library_notices(tiny=True)  # catch_warnings restored the filters setup installed: again
            warnings.warn("`is_gradient_checkpointing` is deprecated (v6).", FutureWarning, stacklevel=1)
            warnings.warn("something else", FutureWarning, stacklevel=1)
        assert [str(w.message) for w in seen] == ["something else"]
        gen, got = logging.getLogger("transformers.generation.utils"), logging.Handler()
        got.emit, got.seen = lambda r: got.seen.append(r.getMessage()), []  # transformers' loggers do not propagate
        gen.addHandler(got)
        try:
            gen.warning("Passing `generation_config` together with generation-related arguments=({'x'}) is ...")
            gen.warning("another notice")
        finally:
            gen.removeHandler(got)
        assert got.seen == ["another notice"]
        assert not hf_logging.is_progress_bar_enabled()
        setup("smoke", "cpu", 0, model=str(Path(__file__).parent))  # then a checkpoint's run: its loading bar back
        assert hf_logging.is_progress_bar_enabled() and len(gen.filters) == 1  # the filter once, however often
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


def test_setup_in_jupyterlab_checks_the_papers_knobs_as_the_parameters_cell_sets_them(monkeypatch, tmp_path):
    """A notebook edited in JupyterLab (its kernel's JPY_SESSION_NAME): `s = 1.5` in Olica's parameters cell is one
    ParamError at the setup cell, as `-p s 1.5` is for the runner; the defaults pass; under the runner it is left
    to the runner."""
    from pathlib import Path
    from types import SimpleNamespace

    import IPython

    from lab.core import records

    nb = Path(__file__).resolve().parents[2] / "notebooks" / "07_olica.ipynb"
    ns = {"s": 0.33, "k": 3.0, "mlp_num": 3, "lc_ratio": 0.1}
    shell = SimpleNamespace(user_ns=ns, extension_manager=SimpleNamespace(loaded=set()))
    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
    monkeypatch.setenv("JPY_SESSION_NAME", str(nb))
    monkeypatch.delenv(records.RECORD_FILE_ENV, raising=False)
    setup("smoke", "cpu", 0)
    for bad, words in [({"s": 1.5}, "s=1.5: out of range; this notebook needs 0 < s < 1."),
                       ({"mlp_num": "3"}, "mlp_num='3' is not an integer (its default is 3).")]:
        ns.update(bad)
        with pytest.raises(ParamError, match=words.replace("(", r"\(").replace(")", r"\)")):
            setup("smoke", "cpu", 0)
        monkeypatch.setenv(records.RECORD_FILE_ENV, "/dev/null")  # the runner checked them before the kernel
        setup("smoke", "cpu", 0)
        monkeypatch.delenv(records.RECORD_FILE_ENV)
        ns.update({"s": 0.33, "mlp_num": 3})
    scratch = tmp_path / "scratch.ipynb"  # not one of the lab's notebooks (no parameters cell): setup as before
    scratch.write_text(nb.read_text().replace('"parameters"', '"params"'))
    monkeypatch.setenv("JPY_SESSION_NAME", str(scratch))
    setup("smoke", "cpu", 0)
    monkeypatch.setenv("JPY_SESSION_NAME", str(tmp_path / "07_olica.ipynb"))  # a copy being edited, cell untagged
    (tmp_path / "07_olica.ipynb").write_text(scratch.read_text())
    setup("smoke", "cpu", 0)
