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


# ---------------------------------------------------------------- the client's and the contract's rules
CLIENT = Path(__import__("lastgood").__file__).resolve().parent
BENCH = Path(__file__).resolve().parents[2] / "bench"


def _strings(path: Path):
    """(line, text) of every string in a module but its docstrings and a table's column
    headings (make_table's arguments), f-strings' literal parts included."""
    tree = ast.parse(path.read_text())
    skip = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    skip |= {id(a) for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(
        n.func, "id", None)) == "make_table" for a in n.args}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            yield node.lineno, node.value


def _spelled(paths, test, owners=()) -> list[str]:
    owners = {Path(o).resolve() for o in owners}
    return [f"{p}:{line}: {text[:80]!r}" for p in sorted(paths) if p.resolve() not in owners
            for line, text in _strings(p) if test(text)]


def _client(*parts: str) -> Path:
    return CLIENT.joinpath(*parts)


def test_checkpoint_statuses_are_the_wires_words_in_the_client():
    from lastgood.wire.vocab import ShardStatus, Status

    words = {s.value for s in Status} | {s.value for s in ShardStatus}
    found = _spelled(CLIENT.rglob("*.py"), lambda t: t in words, [_client("wire", "vocab.py")])
    assert not found, f"use lastgood.wire.vocab.Status: {found}"


def test_the_rank_file_name_has_one_owner():
    found = _spelled([*CLIENT.rglob("*.py"), *SERVICE.rglob("*.py")],
                     lambda t: t.startswith("rank") and t.endswith(".safetensors"), [_client("wire", "format.py")])
    assert not found, f"use lastgood.wire.format.shard_file_name: {found}"


def test_the_s3_checksum_header_has_one_owner():
    from lastgood.wire.s3parts import CHECKSUM_HEADER

    found = _spelled([*CLIENT.rglob("*.py"), *SERVICE.rglob("*.py")], lambda t: t.lower() == CHECKSUM_HEADER,
                     [_client("wire", "s3parts.py")])
    assert not found, f"use lastgood.wire.s3parts.CHECKSUM_HEADER: {found}"


def test_rest_paths_are_built_in_the_rest_client_only():
    found = _spelled(CLIENT.rglob("*.py"), lambda t: t.startswith("/api/v1/") and ":" not in t and " " not in t,
                     [_client("remote", "rest.py")])
    assert not found, f"add a RestClient method (remote/rest.py): {found}"


def test_the_commit_timeout_and_lease_defaults_have_one_owner():
    """`2 x lease + 60` and the default lease are lastgood.wire.info's (Info.commit_timeout)."""
    found = [f"{p}:{node.lineno}" for p in sorted([*CLIENT.rglob("*.py"), *SERVICE.rglob("*.py")])
             if p != _client("wire", "info.py")
             for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
             and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "lease_seconds"]
    assert not found, f"read Info.lease_seconds / Info.commit_timeout: {found}"


def test_one_parser_reads_sizes():
    """No second table from unit names to multipliers (a parser's; rendering a size is not parsing one)."""
    units = {"K", "M", "G", "KB", "MB", "GB", "KIB", "MIB", "GIB"}
    found = [f"{p}:{node.lineno}" for p in sorted([*CLIENT.rglob("*.py"), *BENCH.glob("*.py")])
             if p != _client("common", "sizes.py")
             for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, (ast.Dict, ast.Tuple)) and sum(
                 isinstance(k, ast.Constant) and isinstance(k.value, str) and k.value.upper() in units
                 for k in (node.keys if isinstance(node, ast.Dict) else
                           [e.elts[0] for e in node.elts if isinstance(e, ast.Tuple) and e.elts])) >= 2]
    assert not found, f"use lastgood.common.sizes.parse_size: {found}"


def test_read_leases_are_taken_in_one_place():
    calls = [f"{p}:{node.lineno}" for p in sorted(CLIENT.rglob("*.py"))
             if p not in (_client("remote", "reading.py"), _client("remote", "rest.py"))
             for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and node.func.attr in ("acquire_lease", "release_lease")]
    assert not calls, f"use lastgood.remote.reading.ReadLease: {calls}"


def test_the_replica_reference_is_walked_in_one_place():
    """A state document's replica references are found by wire.format.replica_refs, for the
    service's verify and the client's restore alike (replicas.py walks none itself)."""
    path = _client("restore", "replicas.py")
    walks = [node.lineno for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Compare) and any(isinstance(o, ast.In) for o in node.ops)
             and isinstance(node.left, ast.Name) and node.left.id in ("REF", "REPLICA_REF")]
    assert not walks, f"use lastgood.wire.format.replica_refs: {path}:{walks}"
