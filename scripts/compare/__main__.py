import sys

from scripts.compare.cli import main

sys.exit(main())
