"""``python -m ddplab.agent``: a node's agent (node.py).

Once its work is done (the run delivered, DELIVERY_JSON written, every write committed) the
process ends without interpreter finalization: tearing down MLflow's, SQLAlchemy's and pandas'
module graph took 0.75 s, and the job's rank 0 waits for this process to end before it exits
(``Delivery.close``), so every tracked job was that much longer. atexit's handlers still run,
and stdio is flushed; an exception ends it as Python would.
"""

import atexit
import os

from ..log import flush_std
from .node import main

code = main()
atexit._run_exitfuncs()
flush_std()
os._exit(code)
