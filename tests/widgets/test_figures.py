from lab.widgets import curve, lines


def test_lines_one_trace_per_curve_with_dashes():
    fig = lines([2, 3, 4], {"a": [1.0, 0.9, 0.8], "a ablated": [0.3, 0.2, 0.1]}, title="t",
                dash=lambda name: "ablated" in name)
    assert [t.name for t in fig.data] == ["a", "a ablated"]
    assert list(fig.data[1].y) == [0.3, 0.2, 0.1] and list(fig.data[0].x) == [2, 3, 4]
    assert [t.line.dash for t in fig.data] == ["solid", "dash"]


def test_curve_running_mean():
    fig = curve([0.0, 2.0, 4.0], title="t", smooth=2)
    assert list(fig.data[0].y) == [0.0, 1.0, 3.0]
