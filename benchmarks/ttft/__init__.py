"""Time to first token: how much sooner is the first token, and an exact repeat? (docs/results.md "Time to first token")"""
