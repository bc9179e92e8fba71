"""The server's requirement on the client can be met only by the repository's client.

``switchboard-dispatch`` (clients/python) is on no package index, and the name is not
ours on PyPI: the server pins its exact version with a local label, which PyPI refuses
to host, so no index release matches (tests/deploy/test_container.py resolves it).
"""

from __future__ import annotations

import pathlib
import tomllib

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent


def _project(path: str) -> dict[str, object]:
    project: dict[str, object] = tomllib.loads((ROOT / path).read_text())["project"]
    return project


def test_the_server_pins_the_clients_exact_local_version() -> None:
    client = _project("clients/python/pyproject.toml")
    server = _project("pyproject.toml")
    version = Version(str(client["version"]))
    assert version.local, "a public version could be served by an index"
    dependencies = server["dependencies"]
    assert isinstance(dependencies, list)
    (pin,) = [Requirement(r) for r in dependencies if Requirement(r).name == client["name"]]
    assert str(pin.specifier) == f"=={version}"
    # No release without the label (all an index such as PyPI may hold) meets it.
    for public in (version.public, f"{version.public}.post1", "99.0", f"{version.public}+other"):
        assert not pin.specifier.contains(public, prereleases=True), public
    assert pin.specifier.contains(version)


def test_distribution_and_import_names() -> None:
    assert _project("clients/python/pyproject.toml")["name"] == "switchboard-dispatch"
    assert _project("pyproject.toml")["name"] == "switchboard-dispatch-server"
    assert (ROOT / "clients/python/switchboard_dispatch/__init__.py").is_file()
    # PyPI's `switchboard` (a feature flipper) ships this top-level package: ours must not.
    assert not (ROOT / "clients" / "python" / "switchboard").exists()


def test_the_install_docs_name_the_current_pin() -> None:
    version = _project("clients/python/pyproject.toml")["version"]
    text = (ROOT / "docs/deployment.md").read_text()
    assert f"switchboard-dispatch=={version}" in text
