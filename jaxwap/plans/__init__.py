"""The product: the `Plan` record, its `explain()` report, the time/energy frontier, the plan
cache and the fingerprints behind its key. Imports `core` and `hardware`.
"""
