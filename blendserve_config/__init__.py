"""Configuration and wiring shared by the service (`app`) and the batch CLI (`corpus_cli`).

- `blendserve_config.settings.Settings`: the `BLENDSERVE_*` variables both read (cheap to import: no torch;
  the service-only ones are in `app.settings.ServiceSettings`);
- `blendserve_config.stack.build_stack`: the composition root that builds model, KV store, engine,
  retrieval and the ingestion pipeline from `Settings`; `ingest_sample_on_first_start` beside it.

Log hygiene (`logsafe`) is a leaf package every layer may use.
"""
