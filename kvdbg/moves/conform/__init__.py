"""`kvdbg conform`: an installed engine's attention backend held to the exact reference, feature by feature.

``covering`` makes the rows (a greedy pairwise covering array, or the whole
product), ``matrix`` says which features and levels there are and which step
each cell replays, ``run`` judges the cells (through the ``vllm`` column and
the reference), re-runs a failure on the float32 path and minimises it.

May import :mod:`kvdbg.replayer`, :mod:`kvdbg.backends` and what lies below,
and :mod:`kvdbg.moves.synth`; nothing above the moves.
"""
