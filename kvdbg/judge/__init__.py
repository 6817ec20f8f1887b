"""How kvdbg judges: finding codes and their explanations, the comparison rule, verdicts and exit
codes, error maps of a judged replay.

The vocabulary every other package reports in; pure data and rules. May import :mod:`kvdbg.errors`
and :mod:`kvdbg.util`. Only :mod:`kvdbg.judge.compare` needs torch (imported by its callers' work, never
by ``--help``, ``info`` or ``window``).
"""
