"""Blended prompts on vLLM: Blendserve's blended KV decoded by a vLLM server (docs/results.md "Blended prompts on vLLM")."""
