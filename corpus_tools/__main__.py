import sys

from corpus_tools.cli import main

sys.exit(main())
