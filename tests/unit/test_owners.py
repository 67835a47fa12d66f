"""One owner per rule, checked on the code: a second writer of a rule's state would bring
back the drift the owner exists to prevent (issue 15)."""

import ast
from pathlib import Path

import lastgood_service

SERVICE = Path(lastgood_service.__file__).resolve().parent


def _writes(tree: ast.AST, attr: str) -> list[int]:
    """Lines that assign `x.<attr>` or pass `<attr>=` to a call (an UPDATE's values())."""
    lines = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        lines += [node.lineno for t in targets if isinstance(t, ast.Attribute) and t.attr == attr]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "values":
            lines += [node.lineno for k in node.keywords if k.arg == attr]
    return lines


def test_only_domain_last_good_moves_the_last_good_pointer():
    owner = SERVICE / "domain" / "runs" / "last_good.py"
    found = {str(p.relative_to(SERVICE)): lines for p in sorted(SERVICE.rglob("*.py"))
             if p != owner and (lines := _writes(ast.parse(p.read_text()), "last_good_id"))}
    assert not found, f"call domain/runs/last_good.py (advance, retreat, roll_back_to) instead: {found}"
    assert _writes(ast.parse(owner.read_text()), "last_good_id"), "the owner itself no longer writes it"


def test_the_spool_contract_is_spelled_only_in_the_client_names_module():
    """Both sides of the same-host hand-over read the id file's name, the `.out/`
    directory and the name pattern from lastgood.wire.names; a second spelling would drift."""
    import lastgood
    from lastgood.wire import names

    client = Path(lastgood.__file__).resolve().parent
    owner = client / "wire" / "names.py"
    spellings = ('".lastgood-spool"', "'.lastgood-spool'", '".out"', "'.out'")
    found = {str(p): [s for s in spellings if s in p.read_text()]
             for p in sorted([*SERVICE.rglob("*.py"), *client.rglob("*.py")]) if p != owner}
    found = {p: s for p, s in found.items() if s}
    assert not found, f"use lastgood.wire.names (SPOOL_ID_FILE, SPOOL_OUT_DIR, new_spool_name): {found}"
    assert names.is_spool_name(names.new_spool_name())
    assert names.is_lent_name(f"{names.SPOOL_OUT_DIR}/{names.new_spool_name()}")
