"""The outcome long-poll (api/routes/outcomes.py) is asked by every rank of a job at once, on
the service's one event loop. FastAPI solves each dependency of a route per request, and in a
profile of 1,024 ranks waiting (bench/control_plane.py --profile) those solves were most of
the event loop's time per rank; the route reads the notifier and the settings itself, so
only the app-wide authorizer is solved (docs/control-plane.md)."""

from __future__ import annotations

from lastgood_service.api.routes import outcomes


def _solved(dependant) -> list:
    out = []
    for d in dependant.dependencies:
        out += [d.call, *_solved(d)]
    return out


def test_the_outcome_route_solves_no_dependency_of_its_own():
    (route,) = [r for r in outcomes.router.routes if r.path.endswith("/outcome")]
    assert _solved(route.dependant) == []
    # what it still takes from the request: the checkpoint id (path) and the wait (query)
    assert [p.name for p in route.dependant.path_params] == ["checkpoint_id"]
    assert [p.name for p in route.dependant.query_params] == ["wait"]
