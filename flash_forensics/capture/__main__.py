import sys

from flash_forensics.capture.cli import main

sys.exit(main())
