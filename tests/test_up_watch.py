"""`pagedserve up`'s restart policy for a dead worker: doubling delays after quick deaths, giving up after a run of
them, starting over after a long run."""

from __future__ import annotations

from cli.up_watch import FIRST_RESTART_DELAY_S, MAX_QUICK_DEATHS, MAX_RESTART_DELAY_S, STABLE_RUN_S, RestartPolicy


def test_quick_deaths_double_the_delay_and_a_run_of_them_gives_up() -> None:
    policy = RestartPolicy()
    delays = [policy.delay_after(1.0) for _ in range(MAX_QUICK_DEATHS - 1)]
    assert delays == [min(MAX_RESTART_DELAY_S, FIRST_RESTART_DELAY_S * 2 ** n) for n in range(MAX_QUICK_DEATHS - 1)]
    assert delays[:2] == [1.0, 2.0] and policy.delay_after(1.0) is None


def test_a_long_run_starts_the_count_over() -> None:
    policy = RestartPolicy()
    for _ in range(MAX_QUICK_DEATHS - 1):
        policy.delay_after(0.5)
    assert policy.delay_after(STABLE_RUN_S) == FIRST_RESTART_DELAY_S
    assert policy.delay_after(0.5) == FIRST_RESTART_DELAY_S  # the first quick death of a new count
