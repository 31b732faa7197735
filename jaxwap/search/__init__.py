"""The search: which meshes, each parameter's candidate layouts, the user's constraints, the
tensor-parallel chain, memory repair, the per-mesh solve and the pipelined candidates. Pure
prediction over abstract shapes: imports the layers below, never a device.
"""
