import sys

from corpus_cli.cli import main

sys.exit(main())
