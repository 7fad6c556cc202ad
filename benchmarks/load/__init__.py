"""Throughput under load: how does the running service hold up? (docs/results.md "Throughput under load")"""
