"""The run plots show the run's own numbers: every line is read back from the figure and compared
with the metrics rows it was drawn from, and the saved PNG decodes to the figure's size."""
import matplotlib.image
import numpy as np

from concept.planner.plots import PLANNER_PANELS, planner_curves, planner_figure
from concept.plots import curves_figure, training_curves

ROWS = [
    {"step": 1, "loss": 3.0, "ratio": 0.5},
    {"step": 2, "loss": 2.5, "ratio": 0.4, "eval": {"nll": 2.8, "ratio": 0.3}},
    {"step": 3, "loss": 2.25, "ratio": 0.3},
    {"step": 4, "loss": 2.0, "ratio": 0.25, "eval": {"nll": 2.4, "ratio": 0.26}},
]


def lines(ax):
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines}


def test_training_curves_plot_the_rows():
    fig = curves_figure(ROWS, target_ratio=0.25)
    loss, ratio = fig.axes
    assert lines(loss) == {"train loss": ([1, 2, 3, 4], [3.0, 2.5, 2.25, 2.0]),
                           "held-out NLL": ([2, 4], [2.8, 2.4])}
    drawn = lines(ratio)
    assert drawn["train ratio"] == ([1, 2, 3, 4], [0.5, 0.4, 0.3, 0.25])
    assert drawn["held-out ratio"] == ([2, 4], [0.3, 0.26])
    assert drawn["target 0.25"][1] == [0.25, 0.25]


def test_a_baseline_run_has_no_ratio_panel():
    fig = curves_figure([{"step": s, "loss": 1.0 / s} for s in (1, 2)])
    assert len(fig.axes) == 1 and list(lines(fig.axes[0])) == ["train loss"]


def test_saved_png_decodes_to_the_figure(tmp_path):
    path = training_curves(ROWS, tmp_path / "curves.png", target_ratio=0.25)
    image = matplotlib.image.imread(path)
    assert image.shape[:2] == (400, 1100)  # figsize (11, 4) at 100 dpi
    assert np.ptp(image[..., :3]) > 0.5  # lines on a white page, not a blank image
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png"]  # no temporary file left
    assert training_curves([], tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()


def test_planner_panels_plot_every_key_of_every_run(tmp_path):
    a = [{"step": 1, "loss": 2.0, "entropy/gist": 1.0, "entropy/topic": 0.5},
         {"step": 2, "loss": 1.5, "entropy/gist": 0.8, "entropy/topic": 0.4, "estep_margin": 0.1}]
    b = [{"step": 1, "loss": 2.2}, {"step": 2, "loss": 1.9}]
    fig = planner_figure({"a": a, "b": b})
    panels = {ax.get_title(): ax for ax in fig.axes}
    assert list(panels) == [title for title, _ in PLANNER_PANELS]
    assert lines(panels["train NLL(y | plan)"]) == {"a": ([1, 2], [2.0, 1.5]), "b": ([1, 2], [2.2, 1.9])}
    assert lines(panels["planner entropy per type (nats)"]) == {"a: entropy/gist": ([1, 2], [1.0, 0.8]),
                                                                "a: entropy/topic": ([1, 2], [0.5, 0.4])}
    assert lines(panels["E-step: margin S(z1) − S(z2) (nats)"]) == {"a": ([2], [0.1])}  # step 1 not logged
    assert not panels["gradient norm per group"].lines
    path = planner_curves({"a": a, "empty": []}, tmp_path / "planner.png")
    assert matplotlib.image.imread(path).shape[:2] == (750, 2000)
    assert planner_curves({"empty": []}, tmp_path / "none.png") is None

