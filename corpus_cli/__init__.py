"""The batch CLI (`python -m corpus_cli COMMAND`, also `python -m corpus_tools COMMAND`): an entry point
above the composition root, as `app` is. It reads `Settings`, builds the stack (`blendserve_config`) and
drives the ingestion pipeline (`corpus_tools`)."""
