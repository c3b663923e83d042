import sys

from smtpguard.cli import main

sys.exit(main())
