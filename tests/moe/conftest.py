"""The MoE tests' toy: a random 3-layer Mixtral (d = 32, 4 experts of width 48, top-2), token ids, and its
MoE-block inputs on them."""

import pytest
import torch

from lab.models.zoo import tiny_mixtral
from lab.moe import blocks


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_mixtral(vocab_size=40, d_model=32, n_layers=3, n_heads=4, d_ff=48, n_experts=4).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(40, (4, 16), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def xs(model, ids):
    return blocks.moe_inputs(model, ids)
