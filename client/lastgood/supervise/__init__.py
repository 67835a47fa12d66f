"""`lastgood supervise`: run a job, watch it through the service's verdicts, end its whole
process tree and relaunch it (supervisor, proctree)."""
