"""Shared pieces of the benchmarks, none a benchmark itself: the QA data, scoring, the selection
policies compared, and the report and plots of `python -m benchmarks.run`."""
