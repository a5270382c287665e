"""The node agent: one process per node, beside the job's ranks, that does everything a node
does for its run so training never waits on it. Local rank 0 starts it (before the ranks
import torch); it runs at the lowest CPU priority until the job ends, then for at most
``tracking.delivery_timeout_s``.

    protocol    its command line, its messages (stdin/stdout, JSON lines) and the files it and
                the ranks leave beside the spool: the one place they are defined
    handle      the training process's side: start it (``prestart``), ask it to open rank 0's
                run, tell it the spool, close it at the end (``Delivery``)
    node        the process itself (``python -m ddplab.agent``): opens the run, delivers the
                spool (tracking/spool.py), samples the node's system metrics, ticks the hang
                watch (forensics/watch.py), records the postmortem, ends a run whose rank 0
                died outright
    postmortem  every rank's ending, stacks and the one-line verdict into the run;
                ``ddplab diagnose``
    orphan      the detached watcher a surviving rank leaves: ends the run if global rank 0 is
                gone (``python -m ddplab.agent.orphan``)
    sync        ``ddplab sync``: what an agent could not deliver, after the job

Runs are created and ended through tracking/life.py, tags named by tracking/schema.py.
"""
