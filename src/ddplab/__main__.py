"""``python -m ddplab`` (what torchrun's ``-m ddplab`` runs)."""

import os
import sys

# ``-m`` put the current directory first on sys.path: a user's stray ``random.py`` there would
# be imported instead of the standard library's, by ddplab's own imports (torch's among them).
# Last, not first: a package of the user's there (``model.name: mypkg.net:Net``) still imports.
# (A script's own sys.path is the script's: scriptmode/child.py.)
if not getattr(sys.flags, "safe_path", False) and sys.path and sys.path[0] in ("", os.getcwd()):
    sys.path.append(sys.path.pop(0))

from .cli import entry  # noqa: E402 - after the line above, which any import must follow

entry()
