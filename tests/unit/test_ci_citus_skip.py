"""Under ``CI=true`` a skipped Citus cluster test is a failure (tests/conftest.py):
CI installs Citus, so a skip there would mean the cluster tests silently did
not run. Elsewhere it stays a skip, with its reason."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

_TESTS = """
import pytest

@pytest.mark.citus
def test_on_the_cluster():
    pytest.skip("no Citus cluster: Citus is not installed")

def test_elsewhere():
    pytest.skip("an unrelated reason")
"""


def _run(pytester: pytest.Pytester) -> pytest.RunResult:
    pytester.makeconftest("from tests.conftest import pytest_runtest_makereport  # noqa: F401\n")
    pytester.makeini(
        "[pytest]\nasyncio_default_fixture_loop_scope = function\n"
        "markers =\n    citus: a cluster test\n"
    )
    pytester.makepyfile(_TESTS)
    return pytester.runpytest("-rfs")


def test_under_ci_a_skipped_cluster_test_fails_with_its_reason(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CI", "true")
    result = _run(pytester)
    result.assert_outcomes(failed=1, skipped=1)
    result.stdout.fnmatch_lines(
        ["*CI=true: a Citus cluster test must run, but it skipped*Citus is not installed*"]
    )


def test_elsewhere_a_cluster_test_skips_with_its_reason(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CI", raising=False)
    result = _run(pytester)
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(["*Citus is not installed*"])
