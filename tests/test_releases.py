"""The release: one version everywhere, a changelog that names it, and deprecations that cannot outlive the release
they name (``REMOVED_IN``)."""

from __future__ import annotations

import importlib
import re
import sys
import warnings
from pathlib import Path

from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def test_one_version_and_the_changelog_opens_with_it():
    import paravt_agent

    pyproject = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    changelog = (ROOT / "CHANGELOG.md").read_text()
    first = re.search(r"^## (\S+)", changelog, re.M).group(1)
    assert pyproject == paravt_agent.__version__ == first


def test_deprecated_paths_name_their_removal_and_go_when_it_comes():
    """Every moved module path and renamed config key is in the changelog, and a moved path's warning names the
    release it goes in; once the package reaches that release the aliases must be deleted (this test fails until
    they are)."""
    import paravt_agent
    import paravt_train
    from paravt_agent.compat import REMOVED_IN

    assert Version(paravt_agent.__version__) < Version(REMOVED_IN), (
        f"{paravt_agent.__version__} reached {REMOVED_IN}: delete the MOVED aliases (paravt_agent, paravt_train) and "
        "the deprecated config keys, and their changelog lines")
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"removed in {REMOVED_IN}" in changelog
    from paravt_train.rl.config import GRPOConfig

    for old, new in GRPOConfig.deprecated_keys.items():  # renamed config keys: in the changelog as old → new
        assert f"`{old}:` → `{new or 'nothing'}" in changelog, old
    for old, new in [*paravt_agent.MOVED.items(), *paravt_train.MOVED.items()]:
        assert f"`{old}` → `{new}`" in changelog, old
        sys.modules.pop(old, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            importlib.import_module(old)
        assert any(REMOVED_IN in str(w.message) for w in caught), old
