import numpy as np
import pytest
import torch
from scipy.spatial.distance import pdist, squareform

from lab.moe import hc_smoe as hc
from lab.widgets.hc_smoe import cluster_explorer, cluster_figure, cut_height, groups, tree


def dists():
    g = torch.Generator().manual_seed(0)
    X = [torch.randn(6, 3, generator=g, dtype=torch.float64) for _ in range(2)]
    return X, {"output": [squareform(pdist(x.numpy())) for x in X],
               "weight": [squareform(pdist(x.numpy() ** 3)) for x in X]}


def test_groups_from_distances_match_the_method():
    X, D = dists()
    for r in (2, 3, 5):
        assert np.array_equal(hc.canonical(groups(D["output"][1], r)), hc.cluster(X[1], r))


def test_cut_height_leaves_r_clusters():
    _, D = dists()
    Z = tree(D["output"][0])
    for r in range(1, 7):
        assert len(set((Z[:, 2] < cut_height(Z, r)).nonzero()[0])) == 6 - r


def test_precomputed_figure_slider():
    _, D = dists()
    fig = cluster_figure(D["output"], 3)
    assert len(fig.layout.sliders[0].steps) == 6 and len(fig.layout.shapes) == 2
    step = fig.layout.sliders[0].steps[1]  # r = 2
    assert step.args[0]["shapes"][0]["y0"] == pytest.approx(cut_height(tree(D["output"][0]), 2))


def test_explorer_follows_controls():
    X, D = dists()
    box = cluster_explorer(D, r=4)
    box.controls[0].value = 1
    box.controls[2].value = 2
    assert np.array_equal(hc.canonical(box.labels), hc.cluster(X[1], 2))
    box.controls[1].value = "weight"
    assert box.labels == groups(D["weight"][1], 2)
