"""``python -m ddplab.agent``: a node's agent (node.py)."""

import sys

from .node import main

sys.exit(main())
