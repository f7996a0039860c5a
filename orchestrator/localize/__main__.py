import sys

from orchestrator.localize.cli import main

sys.exit(main())
