"""``python -m symattn``: the command line."""

from symattn.cli import main

raise SystemExit(main())
