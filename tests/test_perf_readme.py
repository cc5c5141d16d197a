"""The README's performance section and perf/results/h100.md match perf/results/h100.json;
the other GPUs' full tables (h200.md) match theirs."""

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


@pytest.mark.parametrize("results", readme_tables.OTHER_RESULTS, ids=lambda p: p.name)
def test_other_gpus_full_tables_match_their_results(results):
    """perf/results/h200.md (runs of a GPU the README quotes in prose only) matches its JSON."""
    if not results.exists():
        pytest.skip(f"{results.name} not committed")
    full = readme_tables.render_full(readme_tables.load(results), results)
    assert results.with_suffix(".md").read_text() == full, (
        f"{results.with_suffix('.md').name} is stale: run `python -m perf readme`"
    )
    assert full.startswith(f"# {results.stem.upper()} results")


def test_readme_has_the_markers():
    readme_tables.extract_section(readme_tables.README.read_text())
