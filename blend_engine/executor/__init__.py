"""The executor: every tensor of a request lives here.

- `layers`: the layer loop (one layer per step), the per-request `KVCache`;
- `placement`: cached chunks' K/V moved to their place by RoPE;
- `selection`: CacheBlend's ranking of deviating tokens and attending from the kept ones;
- `attention`: FlexAttention block masks for the selected rows;
- `prefill`: one prefill from a scheduler's plan to logits and report;
- `decode`: the batched decode step with explicit positions and ragged attention;
- `uploads`: host-built tensors to the device, pinned and non-blocking (no host wait);
- `dispatch_count`: a pass's ops per layer and its host reads, counted (issue #57).
"""
