"""matplotlib, optional: loaded to draw into files, or one error naming the option and how to install it.

Why in the foundation: two features draw (the loss curves of `portspeed compare --plot`, in ``parity``, and the
perf recording's shares of `compare --perf --png`, in ``perf.reading``), and neither may import the other's
package; the loading and its one message are shared here instead. Without matplotlib the numbers are still
reported and decide the exit status: a missing plotting library says nothing about whether runs agree.
"""

from __future__ import annotations

from typing import Any

from portspeed.errors import PortspeedError

__all__ = ["PlotUnavailableError", "load_pyplot", "INSTALL_HINT"]

INSTALL_HINT = "pip install 'portspeed[plot]'  (or: pip install matplotlib)"


class PlotUnavailableError(PortspeedError, ImportError):
    """matplotlib is not installed, so no plot can be drawn."""


def load_pyplot(option: str = "--plot") -> Any:
    """matplotlib's pyplot drawing to files only; `PlotUnavailableError` naming ``option`` and the install hint."""
    try:
        import matplotlib
    except ImportError as e:
        raise PlotUnavailableError(f"{option} needs matplotlib, which is not installed; install it with: "
                                   f"{INSTALL_HINT}") from e
    matplotlib.use("Agg", force=True)  # files only: never open a window or need a display
    import matplotlib.pyplot as plt
    return plt
