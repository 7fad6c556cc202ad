"""Retrieval recall: does retrieval find the supporting passages? (docs/results.md "Retrieval recall")"""
