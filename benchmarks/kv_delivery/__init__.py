"""KV delivery: does the KV cache arrive in time, from each tier? (docs/results.md "KV delivery")"""
