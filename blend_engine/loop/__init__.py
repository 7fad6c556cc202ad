"""The engine loop and its rooms: one thread owns the model and serves every request in continuous
batches (`engine_loop.EngineLoop`, which only orders the work); a request's life (`requests`), a step's
tensors (`stepper`), token output (`output`), work between steps (`background`, `storing`), and what
the loop needs of the engine (`protocol`)."""
