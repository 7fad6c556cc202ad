"""Peer comparison: the same prompts through llama.cpp and vLLM (docs/results.md "Peer comparison")."""
