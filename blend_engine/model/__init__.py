"""The model: its files, formats and CPU kernels; every transformers-internal detail lives here.

- `runner`: `ModelRunner`, a causal LM exposed one layer at a time (embed, Q/K/V at explicit positions,
  finish a layer, RoPE moves, logits);
- `families`: which checkpoints can be blended exactly, RoPE parameters and frequencies, sliding windows;
- `files`: where weights come from (the default GGUF, a `.gguf` file, a checkpoint folder), the cache of
  de-quantized weights, the device and dtype choice for `auto`;
- `gguf_convert`: a GGUF file into a transformers model in one pass;
- `hf_folder`: a GGUF model written out once as a Hugging Face folder for vLLM;
- `packed`: projection weights kept in their GGUF block code for the CPU's few-row steps;
- `cpu_kernels`: Blendserve's CPU kernels (`csrc/cpu_kernels.cpp`), built once per machine;
- `cpu_threads`: one compute thread per process (OpenMP / MKL thread counts).
"""
