"""DDP's gradient-bucket layout, kept across a resume: the one module that touches the
internals of torch.nn.parallel.DistributedDataParallel and its C++ Reducer.

DDP builds its Reducer with the gradients in one bucket, and rebuilds the buckets once,
before a process's second forward, in the order the gradients became ready in its first
backward. All-reduce sums an element in an order that depends on the element's offset in
its bucket, so a resumed process, whose first step reduces in the initial layout, drifts in
the last bits from the run that was not interrupted (from three ranks on: a + b = b + a).

At a save, `layout` records the layout the next step reduces in, as the parameters' names
per bucket, in the Reducer's bucket order. A rebuild that is due is done then, as the next
forward would do it (it is a broadcast; every rank saves). At a restore, `establish`
builds the Reducer anew with the saved layout, the way DDP's own `__setstate__` builds one,
and reads the layout back. What it touches of torch:

- `DistributedDataParallel.reducer`, and on it `_rebuild_buckets()` (what DDP's forward
  calls), `_get_zeros_like_grad_buckets()` (how DDP's join mode reads the layout) and
  `_remove_autograd_hooks()`;
- `DistributedDataParallel._build_params_for_reducer()`, `_build_debug_param_to_name_mapping()`,
  `_ddp_init_helper()` (which constructs the Reducer; `__setstate__` calls it too),
  `_get_ddp_logging_data()`, `_comm_hooks`, `_has_rebuilt_buckets`, `static_graph`;
- `torch.distributed._compute_bucket_assignment_by_size`, which `_ddp_init_helper` calls
  once for the initial layout: for that call it returns the saved layout; and
  `torch.distributed._register_comm_hook`, which puts the Python hooks of `_comm_hooks` on the
  new Reducer.

A missing one raises DDPInternalsChanged naming it, as does a Reducer whose layout read back
is not the saved one: never a resume in another layout without a word. LASTGOOD_DDP_BUCKETS=0
turns all of this off (remote/config.py). Left as built, with a warning: DDP with a
built-in communication hook, `mixed_precision`, the Python reducer (compiled DDP) or
parameters all-reduced outside the Reducer (`param_to_hook_all_reduce`).
"""

from __future__ import annotations

import contextlib
import logging
import weakref

import torch
import torch.distributed as dist
from torch import nn

from lastgood.errors import DDPInternalsChanged
from lastgood.remote.config import ENV_DDP_BUCKETS

log = logging.getLogger("lastgood")

_DDP = nn.parallel.DistributedDataParallel
_DDP_ATTRS = ("_build_params_for_reducer", "_build_debug_param_to_name_mapping", "_ddp_init_helper",
              "_get_ddp_logging_data")
_REDUCER_ATTRS = ("_rebuild_buckets", "_get_zeros_like_grad_buckets", "_remove_autograd_hooks")
_ASSIGN = "_compute_bucket_assignment_by_size"

# a Reducer's layout once it no longer changes (after its rebuild, or one that never
# rebuilds): read once, since reading allocates a copy of every gradient bucket
_final: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _require(ddp: _DDP) -> None:
    missing = [f"DistributedDataParallel.{a}" for a in _DDP_ATTRS if not callable(getattr(ddp, a, None))]
    missing += [f"Reducer.{a}" for a in _REDUCER_ATTRS if not callable(getattr(ddp.reducer, a, None))]
    missing += [f"torch.distributed.{a}" for a in (_ASSIGN, "_register_comm_hook")
                if not callable(getattr(dist, a, None))]
    if missing:
        raise DDPInternalsChanged(_changed(f"lacks {', '.join(missing)}"))


def _changed(what: str) -> str:
    return (f"torch {torch.__version__}: DistributedDataParallel {what}, which lastgood needs to resume "
            f"in DDP's gradient-bucket layout (lastgood/state/ddp_buckets.py). Set {ENV_DDP_BUCKETS}=0 to "
            f"save and restore without it: a resume on three or more ranks then differs in the last bits")


def _unsupported(ddp: _DDP) -> str | None:
    """Why the Reducer of `ddp` is left as built, or None."""
    if getattr(ddp, "_use_python_reducer", False):
        return "the Python reducer (compiled DDP)"
    if getattr(ddp, "_delay_all_reduce_all_params", False) or getattr(ddp, "_delay_all_reduce_params", None):
        return "parameters all-reduced outside the Reducer"
    if getattr(ddp, "mixed_precision", None) is not None:
        return "mixed_precision"
    if ddp._get_ddp_logging_data().get("comm_hook") and not getattr(ddp, "_comm_hooks", None):
        return "a built-in communication hook"
    return None


def _read(ddp: _DDP) -> list[list[str]]:
    names = {id(p): n for n, p in ddp.module.named_parameters()}
    return [[names[id(p)] for p in bucket.parameters()] for bucket in ddp.reducer._get_zeros_like_grad_buckets()]


def _is_final(ddp: _DDP) -> bool:
    """Will the layout of the Reducer of `ddp` stay as it is? After its rebuild (until
    `_update_process_group` resets it), and for one that never rebuilds."""
    return getattr(ddp, "_has_rebuilt_buckets", False) or (bool(ddp.find_unused_parameters) and not ddp.static_graph)


def layout(ddp: _DDP) -> list[list[str]] | None:
    """The bucket layout the next step of `ddp` reduces in (a due rebuild is done now), or
    None for a DDP whose Reducer `establish` leaves as built."""
    _require(ddp)
    if (why := _unsupported(ddp)) is not None:
        log.debug("lastgood: DDP with %s: its gradient-bucket layout is not saved", why)
        return None
    reducer = ddp.reducer
    if reducer._rebuild_buckets():  # what the next forward would do first; a broadcast
        ddp._has_rebuilt_buckets = True
        _final.pop(reducer, None)
    final = _is_final(ddp)
    known = _final.get(reducer) if final else None
    if known is None:
        known = _read(ddp)
        if final:
            _final[reducer] = known
    return known


def establish(ddp: _DDP, saved: list[list[str]] | None) -> None:
    """Build the Reducer of `ddp` anew with the `saved` layout (from `layout`); nothing
    when it reduces in that layout already."""
    if saved is None:
        return  # saved without it (LASTGOOD_DDP_BUCKETS=0, or a DDP left as built)
    _require(ddp)
    if (why := _unsupported(ddp)) is not None:
        log.warning("lastgood: DDP with %s: resuming in DDP's initial gradient-bucket layout; on three or more "
                    "ranks the run may differ in the last bits from one that was not interrupted", why)
        return
    if _is_final(ddp) and _final.get(ddp.reducer) == saved:
        return  # a restore in the same process (a rollback): the layout is already the saved one
    parameters, expect_sparse = ddp._build_params_for_reducer()
    wanted = _indices(ddp, parameters, saved)
    if wanted is None:
        log.warning("lastgood: the checkpoint's DDP bucket layout does not name the parameters this DDP reduces; "
                    "DDP's layout is left as built")
        return
    ddp.reducer._remove_autograd_hooks()
    hooks = list(getattr(ddp, "_comm_hooks", ()))
    with _assignment(wanted, ddp.bucket_bytes_cap):
        ddp._ddp_init_helper(parameters, expect_sparse, ddp._build_debug_param_to_name_mapping(parameters),
                             ddp.static_graph)
    if ddp.static_graph:  # as DDP's __setstate__
        ddp._static_graph_delay_allreduce_enqueued = False
        ddp.reducer._set_static_graph()
        ddp.logger._set_static_graph()
    for hook, state in hooks:
        dist._register_comm_hook(ddp.reducer, state, hook)
    ddp._has_rebuilt_buckets = False  # the new Reducer rebuilds once more, into the same layout
    got = _read(ddp)
    if got != saved:
        raise DDPInternalsChanged(_changed(f"built its Reducer in the layout {got}, not the saved {saved}"))


def _indices(ddp: _DDP, parameters: list, saved) -> list[list[int]] | None:
    """The saved layout as indices into the Reducer's `parameters`; None unless it names
    each of them exactly once."""
    if not isinstance(saved, list) or not all(isinstance(b, list) and all(isinstance(n, str) for n in b)
                                              for b in saved):
        return None
    index = {id(p): i for i, p in enumerate(parameters)}
    by_name = dict(ddp.module.named_parameters())
    wanted = [[index.get(id(by_name.get(n))) for n in bucket] for bucket in saved]
    flat = [i for bucket in wanted for i in bucket]
    return wanted if None not in flat and sorted(flat) == list(range(len(parameters))) else None


@contextlib.contextmanager
def _assignment(wanted: list[list[int]], cap: int):
    """torch.distributed._compute_bucket_assignment_by_size returns `wanted` for the one call
    _ddp_init_helper makes (which reverses the buckets it is given)."""
    calls = []

    def assign(*args, **kwargs):
        calls.append(args)
        return [list(b) for b in reversed(wanted)], [cap] * len(wanted)

    original = getattr(dist, _ASSIGN)
    setattr(dist, _ASSIGN, assign)
    try:
        yield
    finally:
        setattr(dist, _ASSIGN, original)
    if len(calls) != 1:
        raise DDPInternalsChanged(_changed(f"called {_ASSIGN} {len(calls)} times building its Reducer, not once"))
