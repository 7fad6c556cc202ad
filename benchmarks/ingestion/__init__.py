"""Ingestion: how fast are passages ingested and searched? (docs/results.md "Ingestion")"""
