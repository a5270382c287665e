"""When a job hangs, dies or crawls, which rank, where and why: every rank's heartbeat
(``heartbeat``: step, phase, time in a memory-mapped file, and its stack on request), and its
node's delivery process watching them (``watch``: a hang before the collective timeout, the
rank that failed first, the one-line verdict, the stacks as the run's ``forensics/``). Imports
nothing of torch: the watch runs in the delivery process."""
