"""A lent GPU, measured against jaxwap's predictions: the session script that runs there
(`gpu_session.sh`), step time, power, energy and memory per model (`gpu_sweep`), where the
step's time went by kind of kernel (`gpu_trace`, from the sweep's traces), convolutions by shape
against the matmul rate (`conv_probe`), and the power limit as a planned decision set beside
the power the sweeps measured (`power`).
"""
