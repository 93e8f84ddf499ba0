"""`python -m ddptune`: the command line (cli.py)."""
from ddptune.cli import main

raise SystemExit(main())
