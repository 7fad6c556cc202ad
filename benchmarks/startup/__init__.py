"""First start: how soon does a fresh clone's `make run` answer? (docs/results.md "First start")"""
