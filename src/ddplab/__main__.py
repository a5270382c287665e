"""``python -m ddplab`` (what torchrun's ``-m ddplab`` runs)."""

from .cli import entry

entry()
