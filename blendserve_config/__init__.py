"""Configuration and wiring shared by the service (`app`) and the batch CLI (`corpus_tools`).

- `blendserve_config.settings.Settings`: every `BLENDSERVE_*` variable (cheap to import: no torch);
- `blendserve_config.stack.build_stack`: the composition root that builds model, KV store, engine,
  retrieval and the ingestion pipeline from `Settings`; `ingest_sample_on_first_start` beside it;
- `blendserve_config.logsafe`: the process-wide log hygiene both entry points install.
"""
