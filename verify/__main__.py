"""``python -m verify ...`` is ``mla-verify ...``."""

from verify.cli import main

raise SystemExit(main())
