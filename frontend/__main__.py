import sys

from frontend.app import main

sys.exit(main())
