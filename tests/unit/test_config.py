"""The client's settings are resolved once (lastgood.remote.config): an argument wins over the
environment, the environment over the default; each LASTGOOD_* name and each error code is
spelled in one module of the client package only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lastgood
from lastgood.remote import config
from lastgood.remote.config import ClientConfig
from lastgood.remote.retry import RetryPolicy

PACKAGE = Path(lastgood.__file__).resolve().parent


def test_arguments_win_over_the_environment_and_the_environment_over_defaults():
    env = {"LASTGOOD_URL": "http://env:1", "LASTGOOD_TOKEN": "env-token", "LASTGOOD_RUN": "env-run",
           "LASTGOOD_ATTEMPT": "env-attempt", "LASTGOOD_NEW_RUN": "1", "LASTGOOD_USE_SPOOL": "0",
           "LASTGOOD_RETRY_DEADLINE": "7"}
    cfg = ClientConfig.resolve(env=env)
    assert (cfg.url, cfg.token, cfg.run, cfg.attempt, cfg.new_run, cfg.spool, cfg.retry.deadline) == \
        ("http://env:1", "env-token", "env-run", "env-attempt", True, False, 7.0)
    mine = RetryPolicy(deadline=3)
    cfg = ClientConfig.resolve(url="http://arg:2", token="t", run="r", attempt="a", new_run=False, spool=True,
                               retry=mine, env=env)
    assert (cfg.url, cfg.token, cfg.run, cfg.attempt, cfg.new_run, cfg.spool, cfg.retry) == \
        ("http://arg:2", "t", "r", "a", False, True, mine)
    cfg = ClientConfig.resolve(env={})
    assert (cfg.url, cfg.token, cfg.run, cfg.attempt, cfg.new_run, cfg.spool, cfg.retry) == \
        (None, None, None, None, False, True, RetryPolicy())
    assert "env-token" not in repr(ClientConfig.resolve(env=env))  # a token never lands in a log line
    with pytest.raises(Exception):
        cfg.url = "http://elsewhere"  # frozen: resolved once, passed down as it is


@pytest.mark.parametrize("raw,spool", [("0", False), ("false", False), ("no", False), ("off", False),
                                       ("1", True), ("true", True), ("", True), ("maybe", True)])
def test_the_spool_switch_reads_the_same_words_as_the_service(raw, spool):
    """LASTGOOD_USE_SPOOL takes the words the service's own switches take."""
    assert ClientConfig.resolve(env={"LASTGOOD_USE_SPOOL": raw}).spool is spool


def test_the_old_spool_switch_still_works_with_a_warning():
    """LASTGOOD_SPOOL is the service's switch (offer a spool); scripts set it on trainers
    too, so it still turns the client's hand-over off there, with a FutureWarning; the new
    name wins, and without either the spool is used (the control)."""
    with pytest.warns(FutureWarning, match="LASTGOOD_USE_SPOOL"):
        assert ClientConfig.resolve(env={"LASTGOOD_SPOOL": "0"}).spool is False
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ClientConfig.resolve(env={"LASTGOOD_SPOOL": "0", "LASTGOOD_USE_SPOOL": "1"}).spool is True
        assert ClientConfig.resolve(env={}).spool is True


def test_a_bad_retry_setting_names_its_variable():
    with pytest.raises(ValueError, match="LASTGOOD_RETRY_INITIAL"):
        ClientConfig.resolve(env={"LASTGOOD_RETRY_INITIAL": "soon"})


def _constants(path: Path):
    """The string constants of a module, docstrings left out."""
    tree = ast.parse(path.read_text())
    # a string that is a statement of its own has no effect: a docstring, or an attribute's
    # (the dataclass fields torchtitan turns into its command-line help)
    docs = {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            yield node.lineno, node.value


def _modules(*but: str):
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p.name not in but and "v1" not in p.relative_to(PACKAGE).parts]


def test_each_environment_variable_is_named_in_config_only():
    spelled = [f"{p.relative_to(PACKAGE)}:{line}: {value[:60]}" for p in _modules("config.py")
               for line, value in _constants(p) if "LASTGOOD_" in value]
    assert spelled == []
    assert {getattr(config, n) for n in dir(config) if n.startswith("ENV_")} >= {
        "LASTGOOD_URL", "LASTGOOD_TOKEN", "LASTGOOD_RUN", "LASTGOOD_ATTEMPT", "LASTGOOD_USE_SPOOL", "LASTGOOD_NEW_RUN"}


def test_each_error_code_is_named_in_the_wire_only():
    """lastgood.wire.codes spells every error code; the client's classes and the service's
    transports name its constants (a second spelling would drift). Event kinds that share a
    word with a code (a `hash_mismatch` event) are not codes, so the service's domain is not read."""
    import lastgood_service
    from lastgood.wire import codes as wire_codes

    codes = set(wire_codes.CODES) | {wire_codes.HTTP_ERROR}
    service = Path(lastgood_service.__file__).resolve().parent
    files = [*_modules("codes.py"), *sorted((service / "api").rglob("*.py"))]
    spelled = [f"{p}:{line}: {value}" for p in files for line, value in _constants(p) if value in codes]
    assert spelled == []


def test_the_default_file_size_splits_by_the_hosts_cores_and_a_set_one_up_to_four():
    """LASTGOOD_FILE_BYTES unset: 256 MiB files, at most one per core this rank has on its
    host (state/split.files_per_rank); set (environment or argument), the cap is 4 whatever
    the host, as before the default split."""
    from lastgood.remote.config import DEFAULT_FILE_BYTES

    default = ClientConfig.resolve(env={})
    assert default.file_bytes == DEFAULT_FILE_BYTES == 256 << 20 and default.files_by_cores
    for cfg in (ClientConfig.resolve(env={"LASTGOOD_FILE_BYTES": "256M"}), ClientConfig.resolve(file_bytes=0, env={})):
        assert not cfg.files_by_cores
    assert ClientConfig.resolve(env={"LASTGOOD_FILE_BYTES": " "}).files_by_cores  # blank: not set
