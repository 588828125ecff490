"""``python -m frontend.client``: the command-line client (``frontend.cli``)."""
from frontend.cli import main

raise SystemExit(main())
