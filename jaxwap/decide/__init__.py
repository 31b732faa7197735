"""Deciding between candidates: XLA's own figures of a compiled step, verification against
them, measured finalists, the advice on fused attention, why nothing fits, and `choose`,
the one place a `Plan` is built. Imports every layer below; the planner above calls it.
"""
