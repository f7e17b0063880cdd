"""Scheduler unit tests grouped by behaviour (admission, growth, preemption, the executor session, windows and
budgets, forks, tenants, the prefix cache), driven by a stand-in executor (tests/support/fake_executor.py); no process
is started. Shared set-up: tests/support/scheduler_helpers.py."""
