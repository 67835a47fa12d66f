"""The architecture is enforced, not promised: the import-linter contracts in .importlinter
hold on the tree, a deliberate violation breaks them (a control for each kind), and the
service's entry point loads no torch and no client module outside the contract."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path, config: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": f"{root / 'client'}:{root / 'service'}", "PATH": "/usr/bin:/bin"}
    return subprocess.run([str(LINT), "--no-cache", str(config)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)


def _verdict(proc: subprocess.CompletedProcess, contract: str) -> str:
    """KEPT or BROKEN: what lint-imports said of the contract whose name begins `contract`."""
    report = " ".join(proc.stdout.split("Contracts:")[0].split())
    found = re.search(re.escape(contract) + r".*? (KEPT|BROKEN)", report)
    assert found, proc.stdout[-3000:] + proc.stderr[-1000:]
    return found.group(1)


def test_every_contract_holds():
    proc = _lint(ROOT, ROOT / ".importlinter")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "broken" not in proc.stdout.split("Contracts:")[-1].replace("0 broken", "")


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """A copy of both packages, to break on purpose."""
    root = tmp_path_factory.mktemp("tree")
    for part in ("client/lastgood", "service/lastgood_service"):
        shutil.copytree(ROOT / part, root / part, ignore=shutil.ignore_patterns("__pycache__", "static"))
    shutil.copy(ROOT / ".importlinter", root / ".importlinter")
    return root


@pytest.mark.parametrize("module,line,contract", [
    ("client/lastgood/wire/names.py", "from lastgood.remote import config", "lastgood.wire is the contract"),
    ("service/lastgood_service/domain/keys.py", "from lastgood.state import trainstate", "the service imports"),
    ("client/lastgood/export/hf.py", "from lastgood.cli import app", "the command line is a leaf"),
    ("client/lastgood/remote/rest.py", "from lastgood.trainer import checkpointer", "layers import only downwards"),
    # a cycle hidden in a function: hashing -> names at module level, names -> hashing inside a function
    ("client/lastgood/wire/hashing.py", "from lastgood.wire import names", "no import cycles"),
])
def test_a_deliberate_violation_breaks_its_contract(tree, module, line, contract):
    path = tree / module
    original = path.read_text()
    extra = f"\n{line}  # noqa\n"
    if contract == "no import cycles":
        extra += "\n\ndef _cycle():\n    from lastgood.wire import hashing  # noqa: F401\n"
        (tree / "client/lastgood/wire/names.py").write_text(
            (tree / "client/lastgood/wire/names.py").read_text() + extra.split("\n\n\n", 1)[1])
        extra = f"\n{line}  # noqa\n"
    try:
        path.write_text(original + extra)
        proc = _lint(tree, tree / ".importlinter")
        assert proc.returncode != 0 and _verdict(proc, contract) == "BROKEN", proc.stdout[-3000:]
    finally:
        path.write_text(original)
        shutil.copy(ROOT / "client/lastgood/wire/names.py", tree / "client/lastgood/wire/names.py")
    assert _verdict(_lint(tree, tree / ".importlinter"), contract) == "KEPT"  # the control: mended, it holds


def test_the_service_entry_point_loads_no_torch_and_no_client_module_outside_the_contract():
    code = ("import sys, lastgood_service.main\n"
            "print(' '.join(sorted(m for m in sys.modules if m == 'lastgood' or m.startswith('lastgood.'))))\n"
            "print(' '.join(m for m in ('torch', 'numpy', 'rich') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120).stdout
    client, heavy = (out.splitlines() + ["", ""])[:2]
    outside = [m for m in client.split() if m != "lastgood" and not m.startswith(("lastgood.wire", "lastgood.common"))]
    assert client and outside == [], outside
    assert heavy == "", f"the service's entry point imports {heavy}"


def _map(title: str, next_title: str) -> set[str]:
    text = (ROOT / "docs/architecture.md").read_text()
    part = text[text.index(title):text.index(next_title, text.index(title) + len(title))]
    return {tok for cell in re.findall(r"^\| (.+?) \|", part, re.M) for tok in re.findall(r"`([^`]+)`", cell)
            if tok.endswith((".py", "/"))}


def _modules(package: Path, skip=("__init__.py", "__main__.py")) -> set[str]:
    return {str(p.relative_to(package)) for p in package.rglob("*.py")
            if p.name not in skip and "v1" not in p.relative_to(package).parts}


def test_the_client_module_map_matches_the_tree():
    """docs/architecture.md names every client module (or its whole package) and nothing
    that is not there."""
    package = ROOT / "client/lastgood"
    named = _map("### The client's modules", "### The service's modules") - {"client/lastgood/"}
    assert [n for n in named if not (package / n).exists()] == [], "the map names modules that are gone"
    unnamed = [m for m in _modules(package) if m not in named and m.split("/")[0] + "/" not in named]
    assert unnamed == [], f"add these to docs/architecture.md's client map: {unnamed}"


def test_the_service_module_map_names_only_what_is_there():
    package = ROOT / "service/lastgood_service"
    named = _map("### The service's modules", "## How a save commits") - {"service/lastgood_service/"}
    assert [n for n in named if not (package / n).exists()] == [], "the map names modules that are gone"
    packages = {str(p.parent.relative_to(package)) + "/" for p in package.rglob("__init__.py") if p.parent != package}
    unnamed = [d for d in packages if not any(n.startswith(d) for n in named)]
    assert unnamed == [], f"add these packages to docs/architecture.md's service map: {unnamed}"
