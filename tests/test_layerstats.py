"""portspeed.parity.layerstats is retired: its names and `compare --layers` say what replaced them (probe dumps)."""

from __future__ import annotations

import io

import pytest

from portspeed.parity import compare as compare_cli
from portspeed.parity import layerstats


@pytest.mark.parametrize("name", ["LayerStatsRecorder", "compare_layers", "load_layer_stats", "main_compare_layers"])
def test_old_names_point_to_the_probe(name: str) -> None:
    """Each old name raises one line naming `portspeed run --probe DIR` and `compare --probe`."""
    with pytest.raises(layerstats.LayerStatsError) as e:
        getattr(layerstats, name)(object(), iterations=[1])
    assert str(e.value) == layerstats.REPLACED_BY and "\n" not in str(e.value)
    assert "portspeed run --probe DIR" in str(e.value) and "portspeed compare --probe REF_DIR RUN_DIR" in str(e.value)


def test_compare_layers_is_refused_with_what_replaced_it() -> None:
    """`portspeed compare --layers A B`: exit 2, one line naming --probe."""
    err = io.StringIO()
    assert compare_cli.main(["--layers", "a.json", "b.json"], out=io.StringIO(), err=err) == 2
    assert "portspeed compare --probe REF_DIR RUN_DIR" in err.getvalue() and err.getvalue().count("\n") == 1
