"""`python -m cachefs` is the `cachefs` command."""

from cachefs.cli import main

main()
