"""The list of supported families is the tests' own table (tests/families.py), never written by hand."""

from pathlib import Path

import families
import tiny_models

from sinkwatch.capture import SUPPORTED_FAMILIES


def test_readme_family_list_is_generated_from_the_table():
    """docs/metrics.md's family block is exactly what tests/families.py renders (`python tests/families.py --write`)."""
    text = families.readme_path().read_text()
    assert families.readme_with_block(text) == text, "docs/metrics.md's family list is stale: run `python tests/families.py --write`"


def test_every_family_of_the_table_is_tested_and_named_by_the_package():
    """Each row names the test that compares it with eager attention, and that test runs it; the
    package's SUPPORTED_FAMILIES (its error messages) is the same list."""
    assert SUPPORTED_FAMILIES == tuple(families.FAMILIES)
    trained_here = set(tiny_models.FAMILIES)
    assert trained_here <= set(families.FAMILIES)  # every family tests/test_record_vs_eager.py runs is listed
    for name, family in families.FAMILIES.items():
        assert (Path(__file__).parent.parent / family.test).exists(), family.test
        if family.test == families.RECORD_VS_EAGER:
            assert name in trained_here, name  # parametrises tests/test_record_vs_eager.py
        else:
            assert family.test == families.ATTENTION_FAMILIES and name in families.BUILT_HERE, name
