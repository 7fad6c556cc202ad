"""`python -m corpus_tools COMMAND`, the documented command, kept: the CLI itself lives above the
composition root in `corpus_cli` (it builds the stack from settings, as `app` does). This process entry
point is the one corpus_tools module allowed to reach it; nothing imports it (tests/test_import_rules.py)."""

import sys

from corpus_cli.cli import main

sys.exit(main())
