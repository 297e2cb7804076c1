"""``python -m service`` is the ``hsx`` command."""

from service.cli import main

raise SystemExit(main())
