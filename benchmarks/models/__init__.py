"""What the benchmarks plan, compile and run: the model zoo's training steps built from shapes
alone (`zoo`), the layouts set beside the planner's own choice on a mesh (`layouts`), and every
candidate of a workload predicted and compiled on 8 simulated devices, cached under
`results/candidates/` (`candidates`). Shared by the other folders and by the tests.
"""
