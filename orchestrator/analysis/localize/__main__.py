import sys

from flash_forensics.orchestrator.analysis.localize.cli import main

sys.exit(main())
