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
