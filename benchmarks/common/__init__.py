"""Shared pieces of the benchmarks, none a benchmark itself: the QA data, scoring, the selection
policies compared, the running service's helpers (a free port, `python -m app`, its /readyz), and the report
and plots of `python -m benchmarks.run`."""
