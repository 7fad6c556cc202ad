"""Quality vs full prefill: does blend answer like full prefill? (docs/results.md "Quality vs full prefill")"""
