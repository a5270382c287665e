"""The file python runs in a script's own process: ``python -P .../boot.py SCRIPT [ARGS...]``
(or ``... boot.py -m pkg.module [ARGS...]``), started by the rank's supervisor; child.py does
the work.

A file of its own, its script run from its top level, so the script's frames sit one frame
above the stack's bottom, near where ``python SCRIPT`` puts them, not nine as under
``python -m child`` and runpy: code that formats the whole stack pays for every frame below it,
and torch does that on each ``torch.manual_seed`` while CUDA is not initialised
(``torch.cuda._lazy_call`` keeps the caller's stack), as torchvision's ``FakeData`` calls it for
every sample. Eight frames more cost the book's chapter 9 script 5% of its step time
(docs/results/bench-script.md).
"""

import sys

from ddplab.training.scriptmode import child

if __name__ == "__main__":  # (an `if` adds no frame; importing this file runs nothing)
    _script = child.prepare(sys.argv[1:])
    try:
        # (no name of this file's holds the script's code or globals: they are let go at its end)
        exec(*child.main_module(_script))  # noqa: S102 - the user's script, as python runs it
    except BaseException as _e:  # noqa: BLE001 - the script's failure: shown once, kept in the run
        child.end(child.failed(_e))
    child.end(child.returned())
