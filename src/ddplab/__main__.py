"""``python -m ddplab`` (what torchrun's ``-m ddplab`` runs)."""

from .cli import main

raise SystemExit(main())
