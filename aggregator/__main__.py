import sys

from aggregator.cli import main

sys.exit(main())
