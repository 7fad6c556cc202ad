"""Blendserve's side of a stock vLLM server: blended KV handed over, vLLM decodes.

    Blendserve (any host)                          vLLM (stock server, this connector loaded)
    ---------------------                          ------------------------------------------
    blend the prompt on its own engine             scheduler: `kv_transfer_params.blendserve_kv`
    publish its KV: one segment, layer-major  ->     names a segment whose token hash matches the
      (`segments.SegmentPublisher`)                  prompt: all prompt tokens but the last are an
    POST /v1/completions {prompt: token ids,         external hit (0 for a handle that is gone)
      kv_transfer_params: {blendserve_kv: name}}   worker: each layer copied into the paged cache
    stream vLLM's tokens back                  <-    before that layer's attention (`layouts`);
                                                     the segment is freed once loaded

This package imports nothing of Blendserve: `segments` and `layouts` need torch and numpy, the
connector (`connector`) vLLM as well, so a stock vLLM image loads it from a mounted folder
(`PYTHONPATH=/blendserve_vllm/..`). Tested with vLLM 0.32.0 (`SUPPORTED_VLLM`).
"""

SUPPORTED_VLLM = ">=0.32.0,<0.33"
