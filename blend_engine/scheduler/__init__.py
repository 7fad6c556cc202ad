"""The scheduler: what runs next and how much of it, with no tensors and no torch.

- `plans`: per request, what a mode loads and recomputes (integer spans), the ratio and its source;
- `budget`: how many tokens each layer of a blend keeps (the selection and the controller share it);
- `controller`: the ratio from measured load bandwidth and compute speed;
- `batch`: continuous batching (admission by batch size and KV budget, bounded prefill steps).
"""
