"""On a GPU: the one-shot GPU check and its follow-ups (docs/results.md "On a GPU")."""
