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
    owner = SERVICE / "domain" / "last_good.py"
    found = {str(p.relative_to(SERVICE)): lines for p in sorted(SERVICE.rglob("*.py"))
             if p != owner and (lines := _writes(ast.parse(p.read_text()), "last_good_id"))}
    assert not found, f"call domain/last_good.py (advance, retreat, roll_back_to) instead: {found}"
    assert _writes(ast.parse(owner.read_text()), "last_good_id"), "the owner itself no longer writes it"
