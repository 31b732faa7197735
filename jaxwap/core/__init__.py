"""The bottom layer: the plain records every stage passes along (strategies, predictions,
measurements, step variants, the mesh-axis vocabulary), the objective that ranks plans,
figures as people read them, where files live between runs, the progress line, the
garbage collector paused while a plan is made, and the version. It imports nothing else
of jaxwap; every other layer may import it.
"""
