"""Why the two-process gloo cluster of `accuracy.measured` runs slower than predicted: each
collective's own time and wait on both processes' timelines (`cluster_timeline`), and a
candidate's whole work on one core against two cores busy at once (`one_core`).
"""
