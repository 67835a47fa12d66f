"""Run health (docs/health.md):

  heartbeats.py  the catalog half: ranks' heartbeats in, verdicts, events and the
                 checkpoint interval out (Health)
  verdicts.py    hung, straggler and lost verdicts: pure functions of the latest beats
"""
