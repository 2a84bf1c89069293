"""``python -m deploy`` is the ``kvgate`` command."""

from deploy.cli import main

main()
