"""The README's performance section and perf/results/h100.md match perf/results/h100.json."""

import pytest

from perf import readme_tables


@pytest.mark.skipif(
    not readme_tables.RESULTS.exists(),
    reason="perf/results/h100.json not committed yet (made on the H100: python -m perf --help)",
)
def test_readme_matches_committed_results():
    coll = readme_tables.load()
    section = readme_tables.extract_section(readme_tables.README.read_text())
    assert section == readme_tables.render_section(coll).strip("\n"), (
        "README performance section is stale: run `python -m perf readme`"
    )
    assert readme_tables.FULL.read_text() == readme_tables.render_full(coll), (
        "perf/results/h100.md is stale: run `python -m perf readme`"
    )


def test_readme_has_the_markers():
    readme_tables.extract_section(readme_tables.README.read_text())
