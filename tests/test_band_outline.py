"""A quantile band is its polygon filled, without an outline.

Agg strokes a polygon that has an edge colour even at linewidth 0: a
hairline along its edges (on a long run, along every zig-zag of the edges
inside the band: most of the time to draw the bands, and a faint texture).
The panels' bands are filled only: drawn, they are the pixels of their
polygons filled by the same renderer, with no edge.
"""

import cockpit_gradnoise as cgn
from cockpit_gradnoise.views import panels

import matplotlib
import numpy
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure

matplotlib.use("Agg")

LAYER = "layer.weight"


def zigzag_frame(steps: int = 60):
    """A layer whose sd quantiles jump from step to step, as a noisy run's do."""
    rng = numpy.random.default_rng(0)
    output = {}
    for step in range(steps):
        low = 10.0 ** rng.uniform(-4, -2)
        rows = {"q0.05": low, "q0.5": low * 3, "q0.95": low * 10.0 ** rng.uniform(1, 2)}
        output[step] = {"GradientVarianceQuantiles": {LAYER: rows, "all": dict(rows)}}
    return cgn.to_frame(output)


def pixels(fig):
    fig.canvas.draw()
    return numpy.asarray(fig.canvas.buffer_rgba()).copy()


def test_a_band_is_its_polygon_filled_without_an_outline():
    fig = Figure(figsize=(4, 3), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0.1, 0.1, 0.8, 0.8))
    panels.gradient_variance_panel(ax, zigzag_frame(), layers=[LAYER], legend=False)
    for line in list(ax.lines):  # only the band left
        line.remove()
    ax.set_title("")
    ax.set_axis_off()
    (band,) = ax.collections
    drawn = pixels(fig)
    band.remove()
    ax.add_collection(PolyCollection([path.vertices for path in band.get_paths()],
                                     facecolor=band.get_facecolor(), edgecolor="none",
                                     linewidth=0), autolim=False)
    filled = pixels(fig)
    assert (filled[..., :3] != 255).any()  # the polygon covers pixels
    assert numpy.array_equal(drawn, filled)
